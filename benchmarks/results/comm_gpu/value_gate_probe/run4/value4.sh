#!/usr/bin/env bash
set -u
source benchmarks/device_env.sh > /dev/null
mkdir -p $OUT/v; nvidia-smi -L > $OUT/v/machine.txt; python3 -c "import torch; print(torch.__version__)" >> $OUT/v/machine.txt; nproc >> $OUT/v/machine.txt
for run in a b; do
mkdir -p $OUT/v/$run
OUT=$OUT/v/$run timeout 150 torchrun --nproc-per-node 2 benchmarks/results/comm_gpu/value_gate_probe/value_gate4.py > $OUT/v/$run/run.log 2>&1; echo "rc $?"
grep -v -i warn $OUT/v/$run/run.log | grep -E '^\{|stall|Error|error' | cut -c1-250 | head -40
for f in $OUT/v/$run/stall_rank*.txt; do [ -f $f ] && head -3 $f; done
done
tar -czf $OUT/v.tgz -C $OUT v && rm -rf $OUT/v
