#!/bin/bash
# On the GPU machine, from the repository root: the kernels' tests on CUDA, the tile sweep
# (python -m freescale_kernels.tune) and the full benchmark with the sweep's best tiles (the
# JSON's meta.tiles records them). Writes $OUT/gpu_run.log and $OUT/kernels_results.tgz
# (kernels_bench/ with the JSON and plots, tune.json).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$PWD
OUT=${OUT:-$ROOT/out/gpu_check}
W=$(mktemp -d)
LOG=$OUT/gpu_run.log
mkdir -p "$OUT"
t0=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.mem --format=csv >> "$LOG"
stamp "gpu tests"
PYTHONPATH=$ROOT/kernels/src:$ROOT timeout "${TEST_TIMEOUT:-120}" python3 -m pytest \
  tests/kernels/test_triton.py tests/kernels/test_gpu.py -x -q -p no:cacheprovider 2>&1 \
  | tail -8 >> "$LOG"
stamp "tile sweep"
cd "$ROOT/kernels/src" || exit 1
timeout "${TUNE_TIMEOUT:-120}" python3 -m freescale_kernels.tune --out "$W" >> "$LOG" 2>&1
BEST=$(grep '^BEST' "$LOG" | tail -1 | sed 's/^BEST //')
stamp "bench $BEST"
timeout "${BENCH_TIMEOUT:-240}" python3 -m freescale_kernels bench --check --profile $BEST \
  --out "$W/kernels_bench" >> "$LOG" 2>&1
stamp "done"
tar czf "$OUT/kernels_results.tgz" -C "$W" .
