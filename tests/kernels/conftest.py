"""Runs the Triton kernels through Triton's interpreter when there is no GPU.

The variable must be set before Triton decorates the kernels, i.e. before any
``freescale_kernels.ops`` Triton module is imported; pytest loads this file first. On a CUDA
machine the kernels compile for the GPU instead and the same tests run on CUDA tensors.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
