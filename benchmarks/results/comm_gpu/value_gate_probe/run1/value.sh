#!/usr/bin/env bash
set -u
source benchmarks/device_env.sh > /dev/null
mkdir -p $OUT/v; nvidia-smi -L > $OUT/v/machine.txt; python3 -c "import torch; print(torch.__version__)" >> $OUT/v/machine.txt; nproc >> $OUT/v/machine.txt
OUT=$OUT/v timeout 200 torchrun --nproc-per-node 2 benchmarks/results/comm_gpu/value_gate_probe/value_gate.py > $OUT/v/run.log 2>&1; echo "rc $?"
grep -v -i warn $OUT/v/run.log | grep -E '^\{|stall|Error|error' | head -40
for f in $OUT/v/stall_rank*.txt; do [ -f $f ] && head -3 $f; done
if [ "${HANG:-1}" = 1 ]; then
mkdir -p $OUT/v/hang
OUT=$OUT/v/hang timeout 80 torchrun --nproc-per-node 2 benchmarks/results/comm_gpu/value_gate_probe/gate_hang.py > $OUT/v/hang/run.log 2>&1; echo "hang rc $?"; grep -v -i warn $OUT/v/hang/run.log | grep -E "^[01] " ; for f in $OUT/v/hang/hang_rank*.txt; do [ -f $f ] && head -1 $f; done
fi
tar -czf $OUT/v.tgz -C $OUT v && rm -rf $OUT/v
