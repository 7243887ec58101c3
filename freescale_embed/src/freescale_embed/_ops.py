"""Deterministic helpers of the hot path.

Unique IDs come from ``freescale_kernels.unique_with_inverse`` (Triton on CUDA, its PyTorch
reference elsewhere; integers, so exact on both). ``segment_sum`` stays here on purpose:
``freescale_kernels.segment_sum`` fixes each segment's order from the tile, which depends on the
mean segment length, while the prioritized mode needs a segment's sum to depend only on its own
rows and their order (summing a part of the segments must give the bits of summing all). Every
helper's result depends only on its inputs, never on thread count, tensor size or run, and stays
on its inputs' device; the prioritized mode's bitwise equality with synchronous training rests on
these contracts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

import freescale_kernels


def unique_with_inverse(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorted unique values of a 1-D tensor, per input item the index of its value, and how
    many items hold each value (``freescale_kernels.unique_with_inverse``)."""
    result = freescale_kernels.unique_with_inverse(ids)
    return result.values, result.inverse, result.counts


def segment_sum(
    values: torch.Tensor,
    segments: torch.Tensor,
    num_segments: int,
    max_rows: int | None = None,
) -> torch.Tensor:
    """Sums rows of ``values`` by segment id: ``out[s]`` is the sum of ``values[i]`` with
    ``segments[i] == s`` (zero for a segment without rows).

    On CPU the rows of a segment are added one after another in their order in ``values``
    (``0 + v0 + v1 + ...``); elsewhere by ``segment_sum_pairwise``'s fixed tree. Either way a
    segment's result depends only on its own rows and their order, not on the other segments.

    Args:
        values: ``[n, d]`` rows.
        segments: int64 ``[n]``, segment of each row, in ``[0, num_segments)``.
        num_segments: number of output rows.
        max_rows: a bound on the rows of any segment, if the caller knows one (spares the
            pairwise tree a read of the largest segment's size from the device).
    """
    if values.device.type != "cpu":
        # CUDA's index_add_ adds with atomics, in an order that changes from run to run.
        return segment_sum_pairwise(values, segments, num_segments, max_rows)
    out = torch.zeros(num_segments, *values.shape[1:], dtype=values.dtype)
    # CPU index_add_ walks the index sequentially (each step a vectorized row add), which is
    # exactly the documented order; tests/embed/test_ops.py checks it bitwise against a loop.
    return out.index_add_(0, segments, values)


def segment_sum_pairwise(
    values: torch.Tensor,
    segments: torch.Tensor,
    num_segments: int,
    max_rows: int | None = None,
) -> torch.Tensor:
    """``segment_sum`` by a pairwise tree per segment, on any device, deterministically.

    The rows of a segment, in input order, are summed level by level: rows ``2j`` and ``2j+1``
    of a level make row ``j`` of the next (an odd last row passes through). The tree's shape
    depends only on the segment's row count, and each level adds distinct pairs with no
    atomics, so the result depends only on the segment's own rows and their order.

    The levels work in place on the segment-sorted rows: at level ``k`` the row at position
    ``p`` of its segment (``p`` a multiple of ``2**(k+1)``) adds the row at ``p + 2**k`` if the
    segment has one — the same pairs, in the same order, as compacting each level, but with
    shapes fixed in advance. With ``max_rows`` nothing is read back to the host (levels past
    the largest segment add nothing); without it, one read gives the number of levels. Every
    read waits for the GPU, which on a GPU shared by processes can mean a whole time slice.
    """
    device = values.device
    out = torch.zeros(num_segments, *values.shape[1:], dtype=values.dtype, device=device)
    if not segments.numel():
        # Still a function of ``values``, so that a backward through it reaches their producer
        # (a rank with no rows must run its backward's collectives like every other rank).
        return out + values.sum(0)
    # A stable sort keeps each segment's rows in input order.
    segments, order = torch.sort(segments, stable=True)
    values = values.index_select(0, order)
    counts = counts_per_bin(segments, num_segments)
    starts = torch.cumsum(counts, 0) - counts
    index = torch.arange(segments.numel(), device=device)
    position = index - starts.index_select(0, segments)
    rows_of_segment = counts.index_select(0, segments)
    last = segments.numel() - 1
    shape = (-1,) + (1,) * (values.dim() - 1)
    largest = int(counts.max()) if max_rows is None else min(max_rows, segments.numel())
    for level in range(max(largest - 1, 0).bit_length()):
        stride = 1 << level
        adds = (position % (2 * stride) == 0) & (position + stride < rows_of_segment)
        partner = (index + stride).clamp(max=last)
        values = torch.where(adds.view(shape), values + values.index_select(0, partner), values)
    # Each segment's sum is its first row; the other rows go to a spare row past the end, so
    # the copy needs no read of how many heads there are (the heads' targets are distinct).
    target = torch.where(position == 0, segments, num_segments)
    spare = torch.zeros(1, *values.shape[1:], dtype=values.dtype, device=device)
    return torch.cat([out, spare]).index_copy_(0, target, values)[:num_segments]


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


def isin_sorted(elements: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    """``torch.isin(elements, test)`` for an ascending ``test``, reading nothing back from the
    device (CUDA's ``isin`` sorts with a size read)."""
    if test.numel() == 0:
        return torch.zeros_like(elements, dtype=torch.bool)
    at = torch.searchsorted(test, elements).clamp_(max=test.numel() - 1)
    return test.index_select(0, at) == elements


def counts_per_bin(
    values: torch.Tensor, bins: int, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """``bincount(values, weights, minlength=bins)`` as int64 for values below ``bins`` (integer
    or bool ``weights``, 1 each by default), without reading anything back from the device
    (CUDA's bincount reads the largest value first); integer adds are exact in any order."""
    counts = torch.zeros(bins, dtype=torch.int64, device=values.device)
    added = (
        torch.ones_like(values, dtype=torch.int64) if weights is None else weights.to(torch.int64)
    )
    return counts.index_add_(0, values, added)


def indices(masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per mask, the ascending indices of its set elements.

    One read from the device for all of them (a ``nonzero`` per mask would read each size back,
    and each read waits for the GPU).
    """
    found, _ = indices_and_values(masks, [])
    return found


def indices_and_values(
    masks: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[list[Any]]]:
    """``indices(masks)``, and the integer tensors ``values`` as (nested) host lists, in one
    read."""
    if not masks or masks[0].device.type == "cpu":
        return [m.nonzero().flatten() for m in masks], [v.tolist() for v in values]
    sizes = torch.stack([m.sum() for m in masks])
    read = torch.cat([sizes, *(v.reshape(-1).to(torch.int64) for v in values)]).cpu()
    found = [
        torch.nonzero_static(m, size=int(size)).flatten()
        for m, size in zip(masks, read[: len(masks)], strict=True)
    ]
    host, start = [], len(masks)
    for v in values:
        host.append(read[start : start + v.numel()].reshape(v.shape).tolist())
        start += v.numel()
    return found, host


def pack_by_peer(parts: Sequence[torch.Tensor], counts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Interleaves per-part rows into one flat AllToAll buffer, peer-major then part-major.

    Args:
        parts: ``J >= 1`` tensors of one dtype; ``parts[j]`` holds ``sum(counts[p][j])`` rows,
            those for peer 0 first, then peer 1, ...
        counts: ``[world][J]`` on the host, rows of each part for each peer.

    Returns:
        1-D buffer: for each peer, ``parts[0]``'s rows for it, then ``parts[1]``'s, ...
    """
    row_numel = [math.prod(part.shape[1:]) for part in parts]
    pieces = [
        part.reshape(-1).split([row[j] * row_numel[j] for row in counts])
        for j, part in enumerate(parts)
    ]
    return torch.cat([pieces[j][peer] for peer in range(len(counts)) for j in range(len(parts))])


def peer_numel(counts: Sequence[Sequence[int]], row_numel: Sequence[int]) -> list[int]:
    """Elements each peer's slice of a ``pack_by_peer`` buffer holds."""
    return [sum(c * n for c, n in zip(row, row_numel, strict=True)) for row in counts]


def unpack_by_peer(
    buffer: torch.Tensor,
    counts: Sequence[Sequence[int]],
    row_shapes: Sequence[tuple[int, ...]],
) -> list[torch.Tensor]:
    """Inverse of ``pack_by_peer``: per part, its rows from peer 0, then peer 1, ...

    Args:
        buffer: 1-D buffer laid out as ``pack_by_peer`` lays it out.
        counts: ``[world][J]`` on the host, rows of each part from each peer.
        row_shapes: shape of one row of each part (``()`` for scalars).
    """
    num_parts = len(row_shapes)
    row_numel = [math.prod(shape) for shape in row_shapes]
    sizes = [c * n for row in counts for c, n in zip(row, row_numel, strict=True)]
    chunks = buffer.split(sizes)
    return [
        torch.cat([chunks[peer * num_parts + j] for peer in range(len(counts))]).reshape(
            -1, *row_shapes[j]
        )
        for j in range(num_parts)
    ]
