#!/usr/bin/env bash
# Sourced by the device-call scripts of benchmarks/results: on the GPU machine, from the project
# root, installs the ucxx-cu13 wheels carried in .whl/ into /tmp/site and sets PYTHONPATH to this
# tree's packages (``$rest``: every one but freescale_comm, for a script that swaps that in;
# ``$new_path`` this tree's, ``$old_path`` the same with the freescale_comm of an archive of an
# earlier commit carried in out/ab_old). Results go in ``$R``, which ``save`` packs into one
# file under $OUT (only a few files come back from there).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
rest=/tmp/site:$PWD/freescale_balance/src:$PWD/freescale_embed/src:$PWD/kernels/src
export PYTHONPATH=$PWD/freescale_comm/src:$rest
nvidia-smi -L
new_path=$PYTHONPATH
old_path=$PWD/out/ab_old/freescale_comm/src:$rest
R=$OUT/r; mkdir -p "$R"
save() { tar -czf "$OUT/results.tgz" -C "$R" .; }
