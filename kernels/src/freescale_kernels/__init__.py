"""FreeScale kernels: Triton kernels for jagged data movement, each beside a PyTorch reference.

Operations (see ``freescale_kernels.api``): ``jagged_index_select``, ``ranged_dispatch`` /
``ranged_combine``, ``keyed_transpose``, ``unique_with_inverse``, ``segment_sum``. Importing this
package does not import Triton; the kernels load on first use on CUDA tensors (or under
``TRITON_INTERPRET=1`` with ``backend="triton"``).
"""

from freescale_kernels._backend import BACKEND_ENV, resolve_backend
from freescale_kernels.api import (
    jagged_index_select,
    keyed_transpose,
    ranged_combine,
    ranged_dispatch,
    segment_sum,
    unique_with_inverse,
)
from freescale_kernels.layout import Dispatched, JaggedTensor, UniqueResult
from freescale_kernels.tiles import TUNED, CopyTile, SumTile, Tiles

__version__ = "0.1.0"

__all__ = [
    "BACKEND_ENV",
    "TUNED",
    "CopyTile",
    "Dispatched",
    "JaggedTensor",
    "SumTile",
    "Tiles",
    "UniqueResult",
    "jagged_index_select",
    "keyed_transpose",
    "ranged_combine",
    "ranged_dispatch",
    "resolve_backend",
    "segment_sum",
    "unique_with_inverse",
]
