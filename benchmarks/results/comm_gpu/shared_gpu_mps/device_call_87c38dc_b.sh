#!/usr/bin/env bash
set -u
source benchmarks/device_env.sh
git log --oneline -1 2>/dev/null
timeout 150 python3 benchmarks/comm_gpu.py --out $OUT/overlap_mps --parts overlap,latency --rounds 6 --timeout 120 --mps > $OUT/overlap_mps.log 2>&1
echo "== overlap_mps rc=$?"; grep "MPS\|^overlap\|^latency ipc\|^latency gloo" $OUT/overlap_mps.log | cut -c1-600
timeout 120 python3 benchmarks/comm_gpu.py --out $OUT/overlap_no_mps --parts overlap --rounds 6 --timeout 100 > $OUT/overlap_no_mps.log 2>&1
echo "== overlap_no_mps rc=$?"; grep "MPS\|^overlap" $OUT/overlap_no_mps.log | cut -c1-600
mkdir -p /tmp/mps/pipe /tmp/mps/log
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
nvidia-cuda-mps-control -d
timeout 200 python3 -m pytest tests/comm/test_cuda.py -n 4 -q -p no:cacheprovider -o faulthandler_timeout=150 > $OUT/tests_cuda_mps.log 2>&1
echo "tests under MPS rc=$?"; tail -8 $OUT/tests_cuda_mps.log | cut -c1-300
echo quit | nvidia-cuda-mps-control
