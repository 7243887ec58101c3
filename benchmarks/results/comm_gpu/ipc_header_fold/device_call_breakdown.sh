#!/usr/bin/env bash
# Device call: under an MPS server of the script's own, comm_latency.py's phase marks for the
# fold (the tree, b88a3f0) and 87c38dc (out/dev/head, as in device_call_latency.sh), the
# fold's host steps per call, and a cProfile of it.
set -u
source benchmarks/device_env.sh
fold=$PYTHONPATH; base=$PWD/out/dev/head/freescale_comm/src:$rest
mkdir -p /tmp/mps/pipe /tmp/mps/log
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
nvidia-cuda-mps-control -d
PYTHONPATH=$fold timeout 80 python3 benchmarks/comm_latency.py --out $OUT/m1 --cuda-path ipc > $OUT/marks_mps_fold.log 2>&1
PYTHONPATH=$fold timeout 80 python3 benchmarks/comm_host_breakdown.py --device cuda --calls 300 --json $OUT/steps_mps_fold.json > $OUT/steps_mps_fold.log 2>&1
PYTHONPATH=$base timeout 80 python3 benchmarks/comm_latency.py --out $OUT/m2 --cuda-path ipc > $OUT/marks_mps_base.log 2>&1
PYTHONPATH=$fold timeout 80 python3 benchmarks/comm_host_breakdown.py --device cuda --calls 300 --no-steps --profile 30 > $OUT/profile_mps_fold.log 2>&1
echo quit | nvidia-cuda-mps-control
