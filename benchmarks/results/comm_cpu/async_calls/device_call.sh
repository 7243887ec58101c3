#!/usr/bin/env bash
# One device call (the GPU machine's 16-vCPU host, CPU tensors): issue 19's alternated method,
# every call asynchronous (--async-op), the code before (old: out/ab_old, `git archive BASE
# freescale_comm/src freescale_balance/src`) against this tree (new), with this tree's
# synchronous calls beside; 2 and 4 ranks, two rounds; then the CUDA tests. From the project
# root with .whl/ and out/ab_old carried. Results are packed after every run.
set -u
source benchmarks/device_env.sh
lscpu | head -16 > "$R/machine.txt"
for i in 1 2; do
  for ranks in 4 2; do
    for v in old_async new_async new_sync; do
      if [ "${v%%_*}" = old ]; then export PYTHONPATH=$old_path; else export PYTHONPATH=$new_path; fi
      a=(); [ "${v##*_}" = async ] && a=(--async-op)
      f=$R/${v}_${ranks}r_$i
      timeout 150 python3 benchmarks/comm_alternating.py --ranks "$ranks" \
        --sizes 8,4K,64K,1M,2M,4M,16M "${a[@]}" --json "$f.json" > "$f.txt" 2>&1
      echo "== $v $ranks ranks, round $i"; grep -E "^all_" "$f.txt" | cut -c1-110; save
    done
  done
done
export PYTHONPATH=$new_path
timeout 240 python3 -m pytest tests/comm/test_cuda.py tests/comm/test_collectives.py -x -q -p no:cacheprovider -k "cuda or Cuda or asynchronous_calls or small_calls" 2>&1 | tail -4 | tee "$R/tests_cuda.txt"
save; rm -rf "$R"
