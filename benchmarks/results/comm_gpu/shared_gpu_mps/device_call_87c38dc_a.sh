#!/usr/bin/env bash
# committed form: latency with/without MPS
set -u
source benchmarks/device_env.sh
for m in --mps "" --mps; do
  n=lat${m:-_plain}_$RANDOM
  timeout 150 python3 benchmarks/comm_gpu.py --out $OUT/$n --parts latency --timeout 70 $m > $OUT/$n.log 2>&1
  echo "== $n rc=$?"; grep "MPS\|^latency" $OUT/$n.log | cut -c1-220
done
nvidia-smi --query-compute-apps=pid,name --format=csv; pgrep -af mps
