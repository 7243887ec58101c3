"""Which implementation an operation runs: the Triton kernels or the PyTorch reference.

Precedence: the ``backend`` argument, then the ``FREESCALE_KERNELS_BACKEND`` environment variable,
then the device: Triton for CUDA tensors (when Triton is installed), the reference elsewhere.
Forcing Triton on CPU tensors works only under Triton's interpreter (``TRITON_INTERPRET=1``, set
before Triton is first imported), which is how CPU tests run the real kernels.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Literal

import torch

BACKEND_ENV = "FREESCALE_KERNELS_BACKEND"
Backend = Literal["triton", "reference"]
_CHOICES = ("auto", "triton", "reference")


def interpreting() -> bool:
    """Whether Triton kernels run through Triton's CPU interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str | None, tensor: torch.Tensor) -> Backend:
    """The implementation to run for data on ``tensor``'s device.

    Args:
        backend: ``"triton"``, ``"reference"``, ``"auto"`` or ``None`` (use the environment
            variable, else ``"auto"``).
        tensor: the operation's main input; its device decides under ``"auto"``.

    Raises:
        ValueError: an unknown backend name.
        RuntimeError: Triton was forced where it cannot run.
    """
    choice = backend if backend is not None else os.environ.get(BACKEND_ENV, "").strip() or "auto"
    choice = choice.lower()
    if choice not in _CHOICES:
        source = "backend argument" if backend is not None else BACKEND_ENV
        raise ValueError(f"{source} must be one of {_CHOICES}, got {choice!r}")
    if choice == "reference":
        return "reference"
    if choice == "auto":
        return "triton" if tensor.is_cuda and triton_available() else "reference"
    if not triton_available():
        raise RuntimeError("the triton backend was requested but triton is not installed")
    if not tensor.is_cuda and not interpreting():
        raise RuntimeError(
            "the triton backend needs CUDA tensors; to run the kernels on CPU tensors set "
            "TRITON_INTERPRET=1 before triton is first imported"
        )
    return "triton"
