#!/usr/bin/env bash
# benchmarks/train_e2e.py on the GPU machine in one call. With the simulation (SCALE_S > 0, the
# default), the CPU ablation (2, then 4 ranks) runs on cores 2-15 while the simulation runs on
# the GPU from cores 0-1 (disjoint cores; they share memory bandwidth), then 2 ranks share the
# H200 alone. With SCALE_S=0: 2 ranks share the H200, then (SYNCS_S > 0)
# train_e2e_syncs.py counts the ranks' GPU reads, then the CPU ablation, each alone on the
# machine. Each part has its own time bound and the results so far are packed after each, so
# one that overruns leaves the others'; everything lands in $OUT/e2e.tar.gz.
# The command installs the wheels and sets PYTHONPATH first (benchmarks/README.md).
set -u
DIR=/tmp/e2e
mkdir -p "$DIR/cpu" "$DIR/gpu"
pack() { tar czf "${OUT:-/tmp}/e2e.tar.gz" -C /tmp e2e; }
part() {  # part SECONDS CORES DIR ARGS...
  local limit=$1 cores=$2 out=$3; shift 3
  local pin=(taskset -c "$cores")
  command -v taskset > /dev/null || pin=()
  timeout "$limit" "${pin[@]}" python3 benchmarks/train_e2e.py --out "$out" "$@" 2>&1 \
    | grep -v '|' >> "$out/log.txt"
  pack
}
cpu_parts() {
  part "${CPU2_S:-100}" 2-15 "$DIR/cpu" --parts cpu --cpu-worlds 2
  part "${CPU4_S:-100}" 2-15 "$DIR/cpu" --parts cpu --cpu-worlds 4
}
{ nproc; nvidia-smi --query-gpu=name,memory.used --format=csv; } | tee "$DIR/machine.txt"
if [ "${SCALE_S:-230}" -gt 0 ]; then
  cpu_parts &
  part "${SCALE_S:-230}" 0,1 "$DIR/gpu" --parts scale --scale-budget-s "${SCALE_BUDGET_S:-200}"
  wait
  part "${CUDA_S:-100}" 0-15 "$DIR/gpu" --parts cuda
else
  part "${CUDA_S:-100}" 0-15 "$DIR/gpu" --parts cuda
  if [ "${SYNCS_S:-0}" -gt 0 ]; then
    mkdir -p "$DIR/syncs"
    timeout "$SYNCS_S" python3 benchmarks/train_e2e_syncs.py --out "$DIR/syncs" \
      &> "$DIR/syncs/log.txt"
    grep -A14 '^==' "$DIR/syncs/log.txt"
    pack
  fi
  cpu_parts
fi
tail -n 60 "$DIR/cpu/log.txt" "$DIR/gpu/log.txt"
