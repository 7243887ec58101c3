#!/usr/bin/env bash
# Device call: CUDA tests on the tree, then the latency part alternated with HEAD's comm (out/dev/base).
set -u
source benchmarks/device_env.sh
if [ -n "${TESTS-x}" ]; then
timeout ${TEST_S:-280} python3 -m pytest ${TESTS:-tests/comm/test_cuda.py tests/comm/test_failures.py tests/comm/test_integration.py tests/comm/test_liveness.py tests/comm/test_gpu_benchmarks.py tests/comm/test_stream_ops.py} -q -x -p no:cacheprovider -o faulthandler_timeout=120 > $OUT/tests.log 2>&1
echo "tests rc=$?" >> $OUT/tests.log; tail -25 $OUT/tests.log
fi
for r in $(seq 1 ${ROUNDS:-2}); do
  for v in new base; do
    pp=$PYTHONPATH; [ $v = base ] && pp=$PWD/out/dev/base/freescale_comm/src:$rest
    PYTHONPATH=$pp timeout 100 python3 benchmarks/comm_gpu.py --out /tmp/lat_${v}_$r --parts latency --timeout 90 > $OUT/lat_${v}_$r.log 2>&1
    echo "== $v round $r rc=$?"; grep "latency ipc" $OUT/lat_${v}_$r.log
  done
done
