"""FreeScale comm: ``backend="freescale"``, a torch.distributed backend whose AllGather and
AllToAll move data through UCX (copy engines, NICs, CPU threads) instead of GPU SMs; every
other collective is delegated to Gloo (CPU) / NCCL (CUDA) inside the group.

Importing this package registers the backend; with the package installed, torch registers it at
its own import (``torch.backends`` entry point), so
``dist.init_process_group(backend="freescale")`` works after ``import torch`` alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from freescale_comm.errors import (
    FreescaleError,
    FreescalePeerError,
    FreescaleTimeoutError,
    FreescaleValidationError,
)
from freescale_comm.options import FreescaleOptions
from freescale_comm.registration import BACKEND_NAME, autoload, register

if TYPE_CHECKING:
    from freescale_comm.process_group import ProcessGroupFreescale

__version__ = "0.1.0"

# The name torch's entry point refers to (``freescale_comm:_autoload``).
_autoload = autoload

autoload()


def __getattr__(name: str) -> Any:
    # The process group pulls in the backend's machinery; load it only when asked for.
    if name == "ProcessGroupFreescale":
        from freescale_comm.process_group import ProcessGroupFreescale

        return ProcessGroupFreescale
    raise AttributeError(f"module 'freescale_comm' has no attribute {name!r}")


__all__ = [
    "BACKEND_NAME",
    "FreescaleError",
    "FreescaleOptions",
    "FreescalePeerError",
    "FreescaleTimeoutError",
    "FreescaleValidationError",
    "ProcessGroupFreescale",
    "register",
]
