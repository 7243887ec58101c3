"""Deterministic helpers of the hot path, in plain PyTorch.

They stand in for ``freescale_kernels``' ``unique_with_inverse`` and ``segment_sum`` until those
land, and keep their contracts: results depend only on the inputs, never on thread count, tensor
size or run, and ``segment_sum`` adds each segment's rows in their order in the input. The
prioritized mode's bitwise equality with synchronous training rests on these contracts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def unique_with_inverse(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique values of a 1-D tensor and, per input item, the index of its value."""
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    return unique, inverse


def segment_sum(values: torch.Tensor, segments: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Sums rows of ``values`` by segment id: ``out[s] = 0 + sum of values[i] with segments[i]==s``.

    The rows of a segment are added one after another in their order in ``values``, so the result
    of a segment depends only on its own rows and their order (not on the other segments).

    Args:
        values: ``[n, d]`` rows.
        segments: int64 ``[n]``, segment of each row, in ``[0, num_segments)``.
        num_segments: number of output rows; segments without rows are zero.
    """
    if values.device.type != "cpu":
        raise NotImplementedError("segment_sum runs on CPU tensors in this release")
    out = torch.zeros(num_segments, *values.shape[1:], dtype=values.dtype)
    # CPU index_add_ walks the index sequentially (each step a vectorized row add), which is
    # exactly the documented order; tests/embed/test_ops.py checks it bitwise against a loop.
    return out.index_add_(0, segments, values)


def row_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum of each row of ``[n, d]`` by a fixed pairwise tree, the same for every ``n``.

    ``values.sum(1)`` may pick a different reduction order depending on the tensor's size; the
    halving loop below is element-wise across rows, so each row's result depends on that row only.
    """
    width = values.shape[1]
    padded_width = 1 << max(width - 1, 0).bit_length()
    if padded_width != width:
        values = torch.nn.functional.pad(values, (0, padded_width - width))
    while values.shape[1] > 1:
        half = values.shape[1] // 2
        values = values[:, :half] + values[:, half:]
    return values[:, 0]


def pack_by_peer(parts: Sequence[torch.Tensor], counts: torch.Tensor) -> torch.Tensor:
    """Interleaves per-part rows into one flat AllToAll buffer, peer-major then part-major.

    Args:
        parts: ``J`` tensors of one dtype; ``parts[j]`` holds ``counts[:, j].sum()`` rows, those
            for peer 0 first, then peer 1, ...
        counts: int64 ``[world, J]``, rows of each part for each peer.

    Returns:
        1-D buffer: for each peer, ``parts[0]``'s rows for it, then ``parts[1]``'s, ...
    """
    world, num_parts = counts.shape
    row_numel = [math.prod(part.shape[1:]) for part in parts]
    pieces = [
        part.reshape(-1).split((counts[:, j] * row_numel[j]).tolist())
        for j, part in enumerate(parts)
    ]
    ordered = [pieces[j][peer] for peer in range(world) for j in range(num_parts)]
    if not ordered:
        return torch.empty(0, dtype=parts[0].dtype if parts else torch.float32)
    return torch.cat(ordered)


def peer_numel(counts: torch.Tensor, row_numel: Sequence[int]) -> list[int]:
    """Elements each peer's slice of a ``pack_by_peer`` buffer holds."""
    sizes = torch.tensor(list(row_numel), dtype=torch.int64)
    return (counts * sizes[None, :]).sum(1).tolist()


def unpack_by_peer(
    buffer: torch.Tensor, counts: torch.Tensor, row_shapes: Sequence[tuple[int, ...]]
) -> list[torch.Tensor]:
    """Inverse of ``pack_by_peer``: per part, its rows from peer 0, then peer 1, ...

    Args:
        buffer: 1-D buffer laid out as ``pack_by_peer`` lays it out.
        counts: int64 ``[world, J]``, rows of each part from each peer.
        row_shapes: shape of one row of each part (``()`` for scalars).
    """
    world, num_parts = counts.shape
    row_numel = [math.prod(shape) for shape in row_shapes]
    sizes = (counts * torch.tensor(row_numel, dtype=torch.int64)[None, :]).reshape(-1).tolist()
    chunks = buffer.split(sizes)
    return [
        torch.cat([chunks[peer * num_parts + j] for peer in range(world)]).reshape(
            -1, *row_shapes[j]
        )
        for j in range(num_parts)
    ]
