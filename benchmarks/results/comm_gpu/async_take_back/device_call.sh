#!/usr/bin/env bash
# One device call (one GPU shared by 2 ranks, the IPC path): issue 19's alternated method on
# CUDA tensors, every call asynchronous (--async-op) on the code before (old: out/ab_old, `git
# archive BASE freescale_comm/src freescale_balance/src`) and on this tree (new), this tree's
# synchronous calls beside; three rounds; then the CUDA tests. From the project root with
# .whl/ and out/ab_old carried. Results are packed after every run.
set -u
source benchmarks/device_env.sh
nvidia-smi -L > "$R/machine.txt"; lscpu | head -16 >> "$R/machine.txt"
for i in 1 2 3; do
  for v in old_async new_async new_sync; do
    if [ "${v%%_*}" = old ]; then export PYTHONPATH=$old_path; else export PYTHONPATH=$new_path; fi
    a=(); [ "${v##*_}" = async ] && a=(--async-op)
    f=$R/${v}_$i
    timeout 100 python3 benchmarks/comm_alternating.py --device cuda --sizes 8,64K,1M \
      "${a[@]}" --json "$f.json" > "$f.txt" 2>&1
    echo "== $v round $i"; grep -E "^all_" "$f.txt" | cut -c1-90; save
  done
done
export PYTHONPATH=$new_path
timeout 300 python3 -m pytest tests/comm/test_cuda.py -x -q -p no:cacheprovider 2>&1 | tail -4 | tee "$R/tests_cuda.txt"
save; rm -rf "$R"
