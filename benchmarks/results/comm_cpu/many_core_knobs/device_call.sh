#!/usr/bin/env bash
# One device call (the GPU machine's 16-vCPU host, CPU tensors). From the project root, with
# .whl/ and out/ab_old carried (out/ab_old: the base commit's freescale_comm/src and
# freescale_balance/src, `git archive BASE freescale_comm/src freescale_balance/src | tar -x -C
# out/ab_old`):
# 1. freescale comm bench's AllToAll at 2 and 4 ranks, 1-4 MiB, on the base code under each knob
#    set below (FREESCALE_* variables), two rounds in the same order;
# 2. the same under the defaults, base and this tree alternated, two rounds;
# 3. where a rank's time goes at 1 and 4 MiB (comm_host_breakdown.py), base and this tree.
# Results are packed after every run, so a call cut short keeps what it measured.
set -u
source benchmarks/device_env.sh
lscpu | head -16 > "$R/machine.txt"
bench() {  # name, then FREESCALE_* assignments
  local name=$1; shift
  env "$@" timeout 80 python3 -c 'import sys; from freescale_comm.cli import main; sys.exit(main(sys.argv[1:]))' \
    bench --world-sizes 2,4 --min-bytes 1M --max-bytes 4M --factor 2 --ops all_to_all \
    --blocks 7 --target-s 0.04 --out "$R/$name" > "$R/$name.txt" 2>&1
  echo "== $name: $*"; grep -E "^all_" "$R/$name.txt" | cut -c1-130; save
}
declare -A KNOBS=(
  [default]=""
  [yield]="FREESCALE_IDLE_WAIT=yield"
  [one_thread]="FREESCALE_HOST_COPY_THREADS=1"
  [t1_yield]="FREESCALE_HOST_COPY_THREADS=1 FREESCALE_IDLE_WAIT=yield"
  [rings]="FREESCALE_SHM_MAX_BYTES=16777216"
  [rings_outbox256k]="FREESCALE_SHM_MAX_BYTES=16777216 FREESCALE_SHM_OUTBOX_BYTES=262144"
  [outbox256k]="FREESCALE_SHM_OUTBOX_BYTES=262144"
  [t1_reads64k]="FREESCALE_HOST_COPY_THREADS=1 FREESCALE_SHM_MAX_BYTES=65536"
)
export PYTHONPATH=$old_path
for i in 1 2; do
  for k in default yield one_thread t1_yield rings rings_outbox256k outbox256k t1_reads64k; do
    bench "knob_$k$i" ${KNOBS[$k]}
  done
done
for i in 1 2; do
  export PYTHONPATH=$old_path; bench "old$i"
  export PYTHONPATH=$new_path; bench "new$i"
done
for v in old new; do
  if [ "$v" = old ]; then export PYTHONPATH=$old_path; else export PYTHONPATH=$new_path; fi
  for args in "--ranks 4 --bytes-per-peer 256K" "--ranks 4 --bytes-per-peer 1M" "--ranks 2 --bytes-per-peer 2M"; do
    name=breakdown_${v}_$(echo "$args" | tr -d ' -')
    timeout 60 python3 benchmarks/comm_host_breakdown.py $args --calls 300 --json "$R/$name.json" \
      > "$R/$name.txt" 2>&1
    echo "== $name"; head -24 "$R/$name.txt"; save
  done
done
rm -rf "$R"
