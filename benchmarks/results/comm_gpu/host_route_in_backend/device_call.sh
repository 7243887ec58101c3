#!/usr/bin/env bash
# One device call, from the project root of a tree at b44d467 (.whl carried): the CUDA tests of
# the host route (-k host_route, within TEST_S seconds), then the latency part of comm_gpu.py.
set -u
source benchmarks/device_env.sh > /dev/null
mkdir -p $OUT/h
{ nvidia-smi -L; python3 -c "import torch; print(torch.__version__)"; nproc; } > $OUT/h/machine.txt 2>&1
timeout ${TEST_S:-150} python3 -m pytest tests/comm/test_cuda.py -k "host_route" -x -q -p no:cacheprovider > $OUT/h/tests_host_route.log 2>&1; echo "tests rc $?"
tail -25 $OUT/h/tests_host_route.log | grep -v "^$" | cut -c1-300
if [ "${LAT:-1}" = 1 ]; then
timeout ${LAT_S:-150} python3 benchmarks/comm_gpu.py --out $OUT/h/latency --parts latency --timeout 100 > $OUT/h/latency.log 2>&1; echo "latency rc $?"
grep -E "ipc|host|freescale_host" $OUT/h/latency.log | tail -30 | cut -c1-200
fi
tar -czf $OUT/h.tgz -C $OUT h && rm -rf $OUT/h
