#!/usr/bin/env bash
# For a tree at c3ef538 (the route's own thread; never run: no device time was left). From the
# project root, .whl carried: the latency part of comm_gpu.py (with its "host" row), then the
# host route's main CUDA test without xdist (TESTS picks others).
set -u
source benchmarks/device_env.sh > /dev/null
mkdir -p $OUT/h
{ nvidia-smi -L; python3 -c "import torch; print(torch.__version__)"; nproc; } > $OUT/h/machine.txt 2>&1
timeout 60 python3 benchmarks/comm_gpu.py --out $OUT/h/latency --parts latency --timeout 50 > $OUT/h/latency.log 2>&1; echo "latency rc $?"
grep -E "latency (ipc|host|freescale_host) " $OUT/h/latency.log | cut -c1-200
timeout ${TEST_S:-110} python3 -m pytest tests/comm/test_cuda.py -k "${TESTS:-host_route_matches_reference}" -n 0 -v -p no:cacheprovider --timeout 100 > $OUT/h/tests.log 2>&1; echo "tests rc $?"
grep -E "PASS|FAIL|Error|assert|rank [0-9]" $OUT/h/tests.log | grep -v Warning | head -30 | cut -c1-300
tar -czf $OUT/h.tgz -C $OUT h && rm -rf $OUT/h
