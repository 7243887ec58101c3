#!/usr/bin/env bash
# Device call: the latency part under MPS, the tree ("new": at the time the dropped MPS-aware
# variant, README) alternated with out/dev/base (7f04299's freescale_comm/src with this commit's
# cuda.py: the committed code), then new without MPS, then test_cuda.py under MPS.
set -u
source benchmarks/device_env.sh
lat() {  # name, pythonpath, extra args
  PYTHONPATH=$2 timeout 80 python3 benchmarks/comm_gpu.py --out /tmp/$1 --parts latency --timeout 70 $3 > $OUT/$1.log 2>&1
  echo "== $1 rc=$?"; grep "MPS\|^latency ipc\|^latency gloo" $OUT/$1.log | cut -c1-200
}
for r in $(seq 1 ${ROUNDS:-2}); do
  lat mps_new_$r $PYTHONPATH --mps
  lat mps_base_$r $PWD/out/dev/base/freescale_comm/src:$rest --mps
done
lat plain_new $PYTHONPATH ""
if [ -n "${TESTS-x}" ]; then
  mkdir -p /tmp/mps/pipe /tmp/mps/log
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
  nvidia-cuda-mps-control -d
  timeout ${TEST_S:-240} python3 -m pytest ${TESTS:-tests/comm/test_cuda.py} -n 8 -q -p no:cacheprovider -o faulthandler_timeout=100 > $OUT/tests_mps.log 2>&1
  echo "tests rc=$?" >> $OUT/tests_mps.log; tail -15 $OUT/tests_mps.log
  echo quit | nvidia-cuda-mps-control
fi
