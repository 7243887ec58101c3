#!/usr/bin/env bash
# One device call (the GPU machine's 16-vCPU host, CPU tensors): freescale comm bench at 2 and 4
# ranks, 1-16 MiB, alternated old, new, old, new, where old is 653e3e6's freescale_comm (its
# src and freescale_balance's, which it links to, carried as out/ab_old, swapped in through
# PYTHONPATH) and new this tree's; then the
# named-reads and reader-thread tests. From the project root, with .whl/ and out/ab_old carried.
set -u
source benchmarks/device_env.sh
fs() { python3 -c 'import sys; from freescale_comm.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }
lscpu | head -16 > "$R/machine.txt"
for i in 1 2; do
  for v in old new; do
    if [ "$v" = old ]; then export PYTHONPATH=$old_path; else export PYTHONPATH=$new_path; fi
    python3 -c 'import freescale_comm; print(freescale_comm.__file__)'
    fs bench --world-sizes 2,4 --min-bytes 1M --max-bytes 16M --factor 4 --blocks 9 \
      --target-s 0.05 --out "$R/$v$i" > "$R/$v$i.txt" 2>&1
    grep -E "^all_|read from" "$R/$v$i.txt" | cut -c1-140
  done
done
export PYTHONPATH=$new_path
timeout 400 python3 -m pytest tests/comm/test_shm.py -n 0 -q -p no:cacheprovider \
  -k "addresses_headers_name or helper_threads or huge_pages" 2>&1 | tail -5 | tee "$R/tests.txt"
tar -czf "$OUT/results.tgz" -C "$R" . && rm -rf "$R"
