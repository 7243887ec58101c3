"""Multi-GPU head-to-head of freescale_comm against NCCL, in one call: the entry point.

The benchmark is the ``multi_gpu`` package beside this file (its docstring lists the parts and
modules). Run from the project root:

    python benchmarks/multi_gpu_vs_nccl.py --out $OUT          # on the 2-GPU machine
    python benchmarks/multi_gpu_vs_nccl.py --dry-run            # anywhere, CPU only
"""

from __future__ import annotations

from multi_gpu.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
