#!/usr/bin/env bash
# One device call (the GPU machine's 16-vCPU host, CPU tensors): the README's bench and issue
# 19's alternated method (2 and 4 ranks) on this tree. From the project root with .whl/
# carried. Results are packed after every run.
set -u
source benchmarks/device_env.sh
lscpu | head -16 > "$R/machine.txt"
for ranks in 2 4; do
  timeout 120 python3 benchmarks/comm_alternating.py --ranks "$ranks" \
    --sizes 8,64,512,4K,1M,4M,16M --json "$R/alternating_${ranks}ranks.json" \
    > "$R/alternating_${ranks}ranks.txt" 2>&1
  grep -E "^all_" "$R/alternating_${ranks}ranks.txt" | cut -c1-110; save
done
timeout 420 python3 -c 'import sys; from freescale_comm.cli import main; sys.exit(main(sys.argv[1:]))' \
  bench --world-sizes 2,4 --min-bytes 4K --max-bytes 64M --blocks 15 --target-s 0.1 \
  --out "$R" > "$R/comm_bench.log" 2>&1
grep -E "^all_" "$R/comm_bench.log" | cut -c1-130
save; rm -rf "$R"
