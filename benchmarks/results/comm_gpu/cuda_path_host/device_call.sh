#!/usr/bin/env bash
# For a tree at a21b38d (cuda_path="host", reverted after these runs).
# One device call, from the project root with .whl/ carried: the host route's CUDA tests, the
# latency part of comm_gpu.py (its "host" row beside the IPC path and the caller's host
# routes), then the rest of the CUDA tests (REST=0 skips them). Logs in $OUT/r.tgz.
set -u
source benchmarks/device_env.sh > /dev/null
mkdir -p $OUT/r
{ nvidia-smi -L; python3 -c "import torch; print(torch.__version__)"; nproc; } > $OUT/r/machine.txt 2>&1
run_tests() {  # name, -k expression, seconds
  timeout $3 python3 -m pytest tests/comm/test_cuda.py -k "$2" -n 0 -v -p no:cacheprovider \
    --timeout $(($3 - 10)) > $OUT/r/tests_$1.log 2>&1
  echo "tests $1 rc $?"
  grep -E "PASSED|FAILED|ERROR|Timeout|assert" $OUT/r/tests_$1.log | head -20 | cut -c1-300
}
run_tests route "host_route_matches or mismatch_on_the_host" ${ROUTE_S:-150}
timeout ${LATENCY_S:-120} python3 benchmarks/comm_gpu.py --out $OUT/r/latency --parts latency \
  --timeout $((${LATENCY_S:-120} - 10)) > $OUT/r/latency.log 2>&1
echo "latency rc $?"
grep -E "latency (ipc|host|freescale_host|gloo_host) " $OUT/r/latency.log | cut -c1-200
run_tests faults "killed_peer_on_the_host or host_route_cases" ${FAULTS_S:-120}
if [ "${REST:-1}" = 1 ]; then
  timeout ${REST_S:-200} python3 -m pytest tests/comm/test_cuda.py -k "not host_route" -x -q \
    -p no:cacheprovider > $OUT/r/tests_rest.log 2>&1
  echo "tests rest rc $?"; tail -3 $OUT/r/tests_rest.log
fi
tar -czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
