#!/usr/bin/env bash
# Device call (run from the project root on the GPU machine, .whl/ carried): the latency part of
# comm_gpu.py alternated between the tree (the fold, b88a3f0) and out/dev/head (87c38dc's
# freescale_comm/src: git archive 87c38dc freescale_comm/src | tar -x -C out/dev/head), under
# MPS twice each, then once each without MPS, then comm_latency.py's phase marks of the fold.
set -u
source benchmarks/device_env.sh
fold=$PYTHONPATH; base=$PWD/out/dev/head/freescale_comm/src:$rest
lat() {  # name pythonpath args
  PYTHONPATH=$2 timeout 100 python3 benchmarks/comm_gpu.py --out $OUT/$1 --parts latency --timeout 70 $3 > $OUT/$1.log 2>&1
  echo "== $1 rc=$?"; grep "^latency ipc\|^latency gloo" $OUT/$1.log | cut -c1-200
}
for r in 1 2; do lat latency_mps_fold_$r $fold --mps; lat latency_mps_base_$r $base --mps; done
lat latency_no_mps_fold $fold ""; lat latency_no_mps_base $base ""
PYTHONPATH=$fold timeout 100 python3 benchmarks/comm_latency.py --out $OUT/marks --cuda-path ipc > $OUT/marks_no_mps_fold.log 2>&1
