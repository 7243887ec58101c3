"""PyTorch references: the best vectorized eager form of every operation.

Each function has the signature and semantics of its dispatcher in ``freescale_kernels.api``
(without ``backend``) and is differentiable through ordinary autograd. They are the baseline the
Triton kernels are measured against, so they avoid Python loops and host syncs where eager
PyTorch can: the segment bookkeeping is a handful of whole-tensor ops, and the values move with
one ``index_select`` through a per-row source index. What they cannot avoid is materialising that
index (8 bytes per row moved) and one kernel launch per step.
"""

from __future__ import annotations

import torch

from freescale_kernels.layout import (
    Dispatched,
    JaggedTensor,
    UniqueResult,
    as_rows,
    check_ranks,
    check_world_size,
    exclusive_cumsum,
    keyed_lengths,
    num_samples,
    offsets_from_segment_ids,
)


def gather_segments(
    values: torch.Tensor, src_starts: torch.Tensor, out_lengths: torch.Tensor, total_rows: int
) -> torch.Tensor:
    """Concatenates the runs ``values[src_starts[i] : src_starts[i] + out_lengths[i]]``.

    ``total_rows`` must equal ``out_lengths.sum()``; passing it avoids a host sync.
    """
    out_lengths = out_lengths.to(torch.int64)
    out_offsets = exclusive_cumsum(out_lengths)
    shift = src_starts.to(torch.int64) - out_offsets[:-1]
    rows = torch.repeat_interleave(shift, out_lengths, output_size=total_rows)
    rows += torch.arange(total_rows, device=values.device)
    return values.index_select(0, rows)


def rank_major_positions(start: torch.Tensor, count: torch.Tensor, num_keys: int) -> torch.Tensor:
    """int64 ``[F, B]``: where key ``f``'s run of the ``c``-th sample sits in rank-major order.

    Args:
        start: int64 ``[B]``, for the ``c``-th sample (samples grouped by rank), the index of
            its rank's first sample.
        count: int64 ``[B]``, the number of samples of its rank.
        num_keys: ``F``.
    """
    sample = torch.arange(start.numel(), device=start.device)
    key = torch.arange(num_keys, device=start.device)[:, None]
    return num_keys * start + key * count + (sample - start)


def _sort_by_rank(
    ranks: torch.Tensor, world_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted ranks, stable sorting order, int64 bounds ``[W + 1]``) of per-sample ranks."""
    check_world_size(world_size)
    check_ranks(ranks)
    sorted_ranks, order = torch.sort(ranks, stable=True)
    targets = torch.arange(world_size + 1, device=ranks.device, dtype=sorted_ranks.dtype)
    bounds = torch.searchsorted(sorted_ranks, targets).to(torch.int64)
    return sorted_ranks, order, bounds


def jagged_index_select(
    values: torch.Tensor,
    lengths: torch.Tensor,
    indices: torch.Tensor,
    *,
    offsets: torch.Tensor | None = None,
    output_size: int | None = None,
) -> JaggedTensor:
    """Reference of ``freescale_kernels.jagged_index_select``."""
    keyed = keyed_lengths(lengths)
    num_keys, batch = keyed.shape
    flat = keyed.reshape(-1)
    if offsets is None:
        offsets = exclusive_cumsum(flat)
    index = indices.to(torch.int64).reshape(-1)
    keys = torch.arange(num_keys, device=index.device)[:, None]
    segments = (keys * batch + index[None, :]).reshape(-1)
    out_lengths = flat[segments]
    if output_size is None:
        output_size = int(out_lengths.sum()) if out_lengths.numel() else 0
    out = gather_segments(values, offsets.to(torch.int64)[segments], out_lengths, output_size)
    shaped = out_lengths.reshape(num_keys, index.numel()) if lengths.dim() == 2 else out_lengths
    return JaggedTensor(out, shaped)


def ranged_dispatch(
    values: torch.Tensor, lengths: torch.Tensor, ranks: torch.Tensor, world_size: int
) -> Dispatched:
    """Reference of ``freescale_kernels.ranged_dispatch``."""
    keyed = keyed_lengths(lengths)
    num_keys, batch = keyed.shape
    flat = keyed.reshape(-1)
    sorted_ranks, order, bounds = _sort_by_rank(ranks, world_size)
    start = bounds[sorted_ranks]
    positions = rank_major_positions(start, bounds[sorted_ranks + 1] - start, num_keys)
    positions = positions.reshape(-1)
    keys = torch.arange(num_keys, device=flat.device)[:, None]
    source = torch.empty_like(positions)
    source[positions] = (keys * batch + order[None, :]).reshape(-1)
    out_lengths = flat[source]
    out = gather_segments(values, exclusive_cumsum(flat)[source], out_lengths, values.shape[0])

    # Rows per (rank, key): differences of the running row count at the block boundaries.
    out_offsets = exclusive_cumsum(out_lengths)
    counts = bounds[1:] - bounds[:-1]
    block_starts = num_keys * bounds[:-1, None] + keys.T * counts[:, None]
    key_splits = out_offsets[block_starts + counts[:, None]] - out_offsets[block_starts]
    rank_splits = out_offsets[num_keys * bounds[1:]] - out_offsets[num_keys * bounds[:-1]]
    return Dispatched(out, out_lengths, rank_splits, key_splits, counts, order)


def ranged_combine(
    values: torch.Tensor, lengths: torch.Tensor, ranks: torch.Tensor, num_keys: int
) -> JaggedTensor:
    """Reference of ``freescale_kernels.ranged_combine``."""
    batch = ranks.numel()
    if lengths.numel() != num_keys * batch:
        raise ValueError(f"expected {num_keys} x {batch} lengths, got {lengths.numel()}")
    check_ranks(ranks)
    flat = lengths.reshape(-1)
    sorted_ranks, order = torch.sort(ranks, stable=True)
    # Each sample's rank block from the sorted ranks themselves: no world size, no host sync.
    start = torch.searchsorted(sorted_ranks, sorted_ranks)
    end = torch.searchsorted(sorted_ranks, sorted_ranks, right=True)
    positions = rank_major_positions(start, end - start, num_keys)
    source = torch.empty_like(positions)
    source[:, order] = positions
    source = source.reshape(-1)
    out_lengths = flat[source]
    out = gather_segments(values, exclusive_cumsum(flat)[source], out_lengths, values.shape[0])
    return JaggedTensor(out, out_lengths.reshape(num_keys, batch))


def keyed_transpose(
    values: torch.Tensor,
    lengths: torch.Tensor,
    counts: torch.Tensor,
    num_keys: int,
    *,
    to_key_major: bool = True,
) -> JaggedTensor:
    """Reference of ``freescale_kernels.keyed_transpose``."""
    flat = lengths.reshape(-1)
    counts = counts.to(torch.int64)
    total = num_samples(flat, num_keys) if num_keys else int(counts.sum())
    bounds = exclusive_cumsum(counts)
    sample_ranks = torch.repeat_interleave(
        torch.arange(counts.numel(), device=counts.device), counts, output_size=total
    )
    start = bounds[sample_ranks]
    rank_major = rank_major_positions(start, bounds[sample_ranks + 1] - start, num_keys)
    rank_major = rank_major.reshape(-1)
    key_major = torch.arange(num_keys * total, device=flat.device)
    source = torch.empty_like(rank_major)
    if to_key_major:
        source[key_major] = rank_major
    else:
        source[rank_major] = key_major
    out_lengths = flat[source]
    out = gather_segments(values, exclusive_cumsum(flat)[source], out_lengths, values.shape[0])
    return JaggedTensor(out, out_lengths.reshape(num_keys, total) if to_key_major else out_lengths)


def unique_with_inverse(ids: torch.Tensor) -> UniqueResult:
    """Reference of ``freescale_kernels.unique_with_inverse``."""
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    sorted_ids, order = torch.sort(ids, stable=True)
    unique, inverse_sorted, counts = torch.unique_consecutive(
        sorted_ids, return_inverse=True, return_counts=True
    )
    inverse = torch.empty_like(order)
    inverse[order] = inverse_sorted
    return UniqueResult(unique, inverse, counts, exclusive_cumsum(counts), order)


def segment_sum(
    values: torch.Tensor,
    offsets: torch.Tensor | None = None,
    *,
    segment_ids: torch.Tensor | None = None,
    num_segments: int | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of ``freescale_kernels.segment_sum``."""
    offsets = segment_offsets(offsets, segment_ids, num_segments)
    rows = values if order is None else values.index_select(0, order.to(torch.int64))
    flat = as_rows(rows)
    lengths = offsets[1:] - offsets[:-1]
    out_shape = (lengths.numel(), *values.shape[1:])
    if values.dtype.is_floating_point:
        # segment_reduce sums each segment on its own without atomics, so its order is fixed;
        # index_add_ would be faster on CUDA but adds in whatever order atomics land.
        accumulate = torch.float64 if values.dtype == torch.float64 else torch.float32
        summed = torch.segment_reduce(flat.to(accumulate), "sum", lengths=lengths, axis=0)
        return summed.to(values.dtype).reshape(out_shape)
    segment_of_row = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=flat.device), lengths, output_size=flat.shape[0]
    )
    summed = torch.zeros(lengths.numel(), flat.shape[1], dtype=torch.int64, device=flat.device)
    summed.index_add_(0, segment_of_row, flat.to(torch.int64))
    return summed.to(values.dtype).reshape(out_shape)


def segment_offsets(
    offsets: torch.Tensor | None, segment_ids: torch.Tensor | None, num_segments: int | None
) -> torch.Tensor:
    """int64 segment offsets from exactly one of ``offsets`` or sorted ``segment_ids``."""
    if (offsets is None) == (segment_ids is None):
        raise ValueError("pass exactly one of offsets or segment_ids")
    if offsets is not None:
        if offsets.dim() != 1 or offsets.numel() < 1:
            raise ValueError("offsets must be 1-D with at least one entry")
        return offsets.to(torch.int64)
    if num_segments is None:
        raise ValueError("segment_ids needs num_segments")
    return offsets_from_segment_ids(segment_ids, num_segments)
