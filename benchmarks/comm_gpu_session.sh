#!/usr/bin/env bash
# The comm GPU work of one device call (GPU machine, from the project root, after the wheels
# are installed and PYTHONPATH is set as /work/shared/GPU.md says): the CUDA tests, then
# benchmarks/comm_gpu.py, comm_latency.py, shared_gpu_probe.py (its messages and exchanges) and
# comm_host_breakdown.py; everything lands in $OUT/comm_gpu.tgz.
#   TEST_S, BENCH_S, LATENCY_S, PROBE_S, BREAKDOWN_S: time limits of the steps (LATENCY_S per
#   path: ipc, staged; 0 skips the last three); TESTS: the test files (default: the CUDA
#   tests); ROUNDS: overlap rounds.
set -u -o pipefail
results="$OUT/comm_gpu"
mkdir -p "$results"
{
  date -u
  nvidia-smi -L
  python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"
  git rev-parse HEAD 2>/dev/null || true
} >"$results/machine.txt" 2>&1
# shellcheck disable=SC2086  # TESTS is a list of files
timeout "${TEST_S:-120}" python3 -m pytest ${TESTS:-tests/comm/test_cuda.py} -x -q -p no:cacheprovider \
  -o faulthandler_timeout=100 >"$results/tests_cuda.log" 2>&1
echo "tests rc=$?" >>"$results/tests_cuda.log"
tail -3 "$results/tests_cuda.log"
timeout "${BENCH_S:-160}" python3 benchmarks/comm_gpu.py --out "$results" \
  --rounds "${ROUNDS:-10}" --timeout "$((${BENCH_S:-160} - 10))" >"$results/comm_gpu.log" 2>&1
echo "comm_gpu rc=$?" >>"$results/comm_gpu.log"
tail -40 "$results/comm_gpu.log"
if [ "${LATENCY_S:-0}" -gt 0 ]; then
  for path in ipc staged; do
    timeout "$LATENCY_S" python3 benchmarks/comm_latency.py --out "$results" --cuda-path "$path" \
      >>"$results/comm_latency.log" 2>&1
  done
  tail -8 "$results/comm_latency.log"
fi
if [ "${PROBE_S:-0}" -gt 0 ]; then
  timeout "$PROBE_S" python3 benchmarks/shared_gpu_probe.py --out "$results" --parts messages \
    >"$results/shared_gpu_probe.log" 2>&1
  echo "probe rc=$?" >>"$results/shared_gpu_probe.log"
  tail -20 "$results/shared_gpu_probe.log"
fi
if [ "${BREAKDOWN_S:-0}" -gt 0 ]; then
  timeout "$BREAKDOWN_S" python3 benchmarks/comm_host_breakdown.py --device cuda --calls 400 \
    --json "$results/host_breakdown.json" >"$results/host_breakdown.log" 2>&1
  echo "breakdown rc=$?" >>"$results/host_breakdown.log"
  tail -30 "$results/host_breakdown.log"
fi
tar czf "$OUT/comm_gpu.tgz" -C "$OUT" comm_gpu
