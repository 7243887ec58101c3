#!/usr/bin/env bash
# One device call, from the project root (``.whl`` carried):
#   bash benchmarks/results/comm_gpu/value_gate_probe/device_call.sh SWEEP "RUNS" [hang]
# runs value_gate.py's sweep SWEEP once per name in RUNS (each under $OUT/v/NAME), then with
# ``hang`` gate_hang.py (ae3afa3's comm_gpu.py and overlap_rounds.py beside it), and packs $OUT/v.tgz.
set -u
here=$PWD/benchmarks/results/comm_gpu/value_gate_probe
source benchmarks/device_env.sh > /dev/null
mkdir -p "$OUT/v"
{ nvidia-smi -L; python3 -c "import torch; print(torch.__version__)"; nproc; } > "$OUT/v/machine.txt"
for run in $2; do
  mkdir -p "$OUT/v/$run"
  OUT=$OUT/v/$run timeout 150 torchrun --nproc-per-node 2 "$here/value_gate.py" "$1" > "$OUT/v/$run/run.log" 2>&1
  echo "$run rc $?"
  grep -v -i warn "$OUT/v/$run/run.log" | grep -E '^\{|Error' | cut -c1-250 | head -40
done
if [ "${3:-}" = hang ]; then
  mkdir -p "$OUT/v/hang" /tmp/ae3afa3
  for module in comm_gpu overlap_rounds; do
    git show "ae3afa3:benchmarks/$module.py" > "/tmp/ae3afa3/$module.py"
  done
  OUT=$OUT/v/hang GATE_AHEAD=${GATE_AHEAD:-0} PYTHONPATH=/tmp/ae3afa3:$PYTHONPATH timeout 80 torchrun --nproc-per-node 2 \
    "$here/gate_hang.py" > "$OUT/v/hang/run.log" 2>&1
  echo "hang rc $?"
  head -qn1 "$OUT"/v/hang/hang_rank*.txt
  grep -E '^[01] loop' "$OUT/v/hang/run.log"
fi
tar -czf "$OUT/v.tgz" -C "$OUT" v && rm -rf "$OUT/v"
