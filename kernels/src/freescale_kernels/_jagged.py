"""``JaggedTensor``: the one jagged container of FreeScale (values plus run lengths).

Shared by symbolic link (``freescale_kernels/_jagged.py`` is the file, ``freescale_balance``
links it): each of the two installs alone, kernels never imports balance, and when both are
installed ``freescale_balance`` re-exports this module's class from ``freescale_kernels`` so the
two public names are one class (``freescale_balance/jagged.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


class JaggedBatchError(ValueError):
    """A batch that is not well formed (lengths, values, shapes or dtypes)."""


@dataclass(frozen=True)
class JaggedTensor:
    """Variable-length runs of values: one run per sample (and per key, when keyed).

    Unpacks as its two fields (``values, lengths = jagged``), like the pair it holds.

    Args:
        values: ``[sum(lengths), *item_shape]``; every run, in the order ``lengths`` lists them.
        lengths: integer run lengths. ``[batch_size]``: one run per sample (a feature of a
            batch). ``[F, B]``: a keyed jagged tensor, key-major (``freescale_kernels``'
            operations read and return it; flat ``[F * B]`` lengths in the rank-major layout
            between ranks, see ``freescale_kernels.layout``).
    """

    values: torch.Tensor
    lengths: torch.Tensor

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.values, self.lengths))

    @property
    def batch_size(self) -> int:
        """Samples: ``B`` of ``[F, B]`` lengths, else the number of lengths."""
        if self.lengths.dim() == 2:
            return int(self.lengths.shape[1])
        return int(self.lengths.numel())

    def offsets(self) -> torch.Tensor:
        """Where each run starts, then the end: int64 ``[lengths.numel() + 1]``, on lengths'
        device (runs in the flat ``lengths.reshape(-1)`` order)."""
        offsets = torch.zeros(
            self.lengths.numel() + 1, dtype=torch.int64, device=self.lengths.device
        )
        torch.cumsum(self.lengths.reshape(-1), 0, out=offsets[1:])
        return offsets

    def validate(self, name: str = "feature") -> None:
        """Raises ``JaggedBatchError`` unless lengths are 1-D non-negative ints covering values."""
        lengths = self.lengths
        if lengths.dim() != 1:
            raise JaggedBatchError(f"{name}: lengths must be 1-D, got shape {tuple(lengths.shape)}")
        if (
            lengths.dtype.is_floating_point
            or lengths.dtype.is_complex
            or lengths.dtype == torch.bool
        ):
            raise JaggedBatchError(
                f"{name}: lengths must be an integer tensor, got {lengths.dtype}"
            )
        if self.values.dim() < 1:
            raise JaggedBatchError(f"{name}: values must have at least one dimension")
        if lengths.numel() and int(lengths.min()) < 0:
            bad = int(torch.nonzero(lengths < 0)[0])
            raise JaggedBatchError(
                f"{name}: length of sample {bad} is negative ({int(lengths[bad])})"
            )
        total = int(lengths.sum()) if lengths.numel() else 0
        if total != self.values.shape[0]:
            raise JaggedBatchError(
                f"{name}: lengths sum to {total} but values hold {self.values.shape[0]} items"
            )

    def select(self, indices: torch.Tensor) -> JaggedTensor:
        """The samples at ``indices`` (any order, repeats allowed) of 1-D lengths, as a new
        jagged tensor (``freescale_kernels.jagged_index_select`` does it for keyed ones)."""
        indices = indices.to(torch.int64)
        lengths = self.lengths.to(torch.int64)
        picked_lengths = lengths[indices]
        starts = self.offsets()[:-1][indices]
        # Each output item reads values[start of its sample + its position within the sample].
        out_offsets = torch.zeros_like(picked_lengths)
        if picked_lengths.numel() > 1:
            torch.cumsum(picked_lengths[:-1], 0, out=out_offsets[1:])
        total = int(picked_lengths.sum()) if picked_lengths.numel() else 0
        device = lengths.device
        sample_of_item = torch.repeat_interleave(
            torch.arange(picked_lengths.numel(), device=device), picked_lengths, output_size=total
        )
        positions = torch.arange(total, device=device) - out_offsets[sample_of_item]
        source = starts[sample_of_item] + positions
        return JaggedTensor(self.values[source], self.lengths[indices])

    def equal(self, other: JaggedTensor) -> bool:
        """Exact equality of dtypes, shapes and contents of both fields."""
        return (
            self.values.dtype == other.values.dtype
            and self.lengths.dtype == other.lengths.dtype
            and torch.equal(self.values, other.values)
            and torch.equal(self.lengths, other.lengths)
        )
