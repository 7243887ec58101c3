#!/usr/bin/env bash
# One device call (the GPU machine's 16-vCPU host, CPU tensors): freescale comm bench, AllToAll
# and AllGather at 2 and 4 ranks, 1-16 MiB, alternating the base code (old) and this tree
# (new), three rounds; then the reads and helper-thread tests on this host. From the project
# root, with .whl/ and out/ab_old carried (out/ab_old: `git archive BASE freescale_comm/src
# freescale_balance/src | tar -x -C out/ab_old`). Results are packed after every run.
set -u
source benchmarks/device_env.sh
lscpu | head -16 > "$R/machine.txt"
for i in 1 2 3; do
  for v in old new; do
    if [ "$v" = old ]; then export PYTHONPATH=$old_path; else export PYTHONPATH=$new_path; fi
    timeout 120 python3 -c 'import sys; from freescale_comm.cli import main; sys.exit(main(sys.argv[1:]))' \
      bench --world-sizes 2,4 --min-bytes 1M --max-bytes 16M --factor 2 \
      --blocks 7 --target-s 0.04 --out "$R/$v$i" > "$R/$v$i.txt" 2>&1
    echo "== $v$i"; grep -E "^all_" "$R/$v$i.txt" | cut -c1-130; save
  done
done
export PYTHONPATH=$new_path
timeout 150 python3 -m pytest tests/comm/test_shm.py -n 0 -q -p no:cacheprovider \
  -k "addresses_headers_name or helper_threads or huge_pages" 2>&1 | tail -5 | tee "$R/tests.txt"
save; rm -rf "$R"
