"""Triton ranged dispatch / combine and keyed transpose: rank-major <-> key-major jagged layouts.

All three move key ``f``'s run of the ``c``-th sample (samples grouped by rank) between its
key-major slot ``f * B + sample`` and its rank-major slot

    ``p = F * start[r] + f * count[r] + (c - start[r])``

where ``r`` is the sample's rank, ``start[r]`` the first sample of rank ``r`` and ``count[r]``
its sample count. The plan kernel evaluates that closed form once per run, so planning costs
``O(F * B)`` whatever the world size; the rows then move with one ``gather_segments`` copy.

Launches per call (dispatch): a stable sort of the ranks (torch), the rank bounds, two running
sums (torch), the plan, the split sizes and the copy. No host sync: the output has as many rows
as the input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freescale_kernels._backend import interpreting
from freescale_kernels.layout import (
    Dispatched,
    Jagged,
    check_ranks,
    check_world_size,
    exclusive_cumsum,
    keyed_lengths,
    num_samples,
)
from freescale_kernels.ops.jagged_copy import (
    find_segment,
    lower_bound,
    permute_segments,
)

_BLOCK = 1024
_INTERPRETER_BLOCK = 1 << 14


def _block() -> int:
    return _INTERPRETER_BLOCK if interpreting() else _BLOCK


# Search widths (world size, sample count) stay runtime values even when 1 (see find_segment).
@triton.jit(do_not_specialize=["num_samples"])
def _rank_bounds_kernel(sorted_ranks, bounds, num_samples, world_size, BLOCK: tl.constexpr):
    ranks = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = ranks <= world_size
    first = lower_bound(sorted_ranks, num_samples, ranks, mask)
    tl.store(bounds + ranks, first, mask=mask)


@triton.jit(do_not_specialize=["num_samples", "world_size"])
def _rank_major_plan_kernel(
    in_lengths,
    in_offsets,
    order,
    sorted_ranks,
    bounds,
    out_lengths,
    src_starts,
    positions,
    num_keys,
    num_samples,
    world_size,
    HAS_ORDER: tl.constexpr,
    HAS_RANKS: tl.constexpr,
    HAS_BOUNDS: tl.constexpr,
    TO_RANK_MAJOR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    runs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = runs < num_keys * num_samples
    key = runs // num_samples
    sample = runs % num_samples  # in rank order
    if HAS_RANKS:
        rank = tl.load(sorted_ranks + sample, mask=mask, other=0).to(tl.int64)
    else:
        rank = find_segment(bounds, 0, world_size, world_size, sample, mask)
    if HAS_BOUNDS:
        start = tl.load(bounds + rank, mask=mask, other=0)
        count = tl.load(bounds + rank + 1, mask=mask, other=0) - start
    else:
        start = lower_bound(sorted_ranks, num_samples, rank, mask)
        count = lower_bound(sorted_ranks, num_samples, rank + 1, mask) - start
    rank_major = num_keys * start + key * count + (sample - start)
    original = tl.load(order + sample, mask=mask, other=0) if HAS_ORDER else sample
    key_major = key * num_samples + original
    if TO_RANK_MAJOR:
        src = key_major
        dst = rank_major
    else:
        src = rank_major
        dst = key_major
    tl.store(out_lengths + dst, tl.load(in_lengths + src, mask=mask), mask=mask)
    tl.store(src_starts + dst, tl.load(in_offsets + src, mask=mask), mask=mask)
    tl.store(positions + src, dst, mask=mask)


@triton.jit
def _splits_kernel(
    bounds,
    out_offsets,
    key_splits,
    rank_splits,
    sample_counts,
    num_keys,
    world_size,
    BLOCK: tl.constexpr,
):
    blocks = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = blocks < world_size * num_keys
    rank = blocks // num_keys
    key = blocks % num_keys
    start = tl.load(bounds + rank, mask=mask, other=0)
    count = tl.load(bounds + rank + 1, mask=mask, other=0) - start
    first = num_keys * start + key * count
    rows = tl.load(out_offsets + first + count, mask=mask, other=0)
    rows -= tl.load(out_offsets + first, mask=mask, other=0)
    tl.store(key_splits + blocks, rows, mask=mask)
    lead = mask & (key == 0)
    rank_rows = tl.load(out_offsets + num_keys * (start + count), mask=lead, other=0)
    rank_rows -= tl.load(out_offsets + num_keys * start, mask=lead, other=0)
    tl.store(rank_splits + rank, rank_rows, mask=lead)
    tl.store(sample_counts + rank, count, mask=lead)


def _plan(
    flat_lengths: torch.Tensor,
    num_keys: int,
    num_samples_: int,
    *,
    bounds: torch.Tensor | None,
    sorted_ranks: torch.Tensor | None,
    order: torch.Tensor | None,
    to_rank_major: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out_lengths, out_offsets, src_starts, in_offsets, positions) of one layout change.

    The rank of each sample comes from ``sorted_ranks`` or, without them, from ``bounds``; the
    first sample and sample count of a rank from ``bounds`` or, without them, by searching
    ``sorted_ranks``.
    """
    runs = flat_lengths.numel()
    device = flat_lengths.device
    in_offsets = exclusive_cumsum(flat_lengths)
    out_lengths = torch.empty_like(flat_lengths)
    src_starts = torch.empty(runs, dtype=torch.int64, device=device)
    positions = torch.empty(runs, dtype=torch.int64, device=device)
    if runs:
        block = _block()
        world_size = bounds.numel() - 1 if bounds is not None else 0
        placeholder = in_offsets  # never read: the matching HAS_* flag is off
        _rank_major_plan_kernel[(triton.cdiv(runs, block),)](
            flat_lengths,
            in_offsets,
            order if order is not None else placeholder,
            sorted_ranks if sorted_ranks is not None else placeholder,
            bounds if bounds is not None else placeholder,
            out_lengths,
            src_starts,
            positions,
            num_keys,
            num_samples_,
            world_size,
            HAS_ORDER=order is not None,
            HAS_RANKS=sorted_ranks is not None,
            HAS_BOUNDS=bounds is not None,
            TO_RANK_MAJOR=to_rank_major,
            BLOCK=block,
        )
    return out_lengths, exclusive_cumsum(out_lengths), src_starts, in_offsets, positions


def ranged_dispatch(
    values: torch.Tensor, lengths: torch.Tensor, ranks: torch.Tensor, world_size: int
) -> Dispatched:
    """Triton ``freescale_kernels.ranged_dispatch`` (ranks are not range-checked)."""
    check_world_size(world_size)
    check_ranks(ranks)
    keyed = keyed_lengths(lengths)
    num_keys, batch = keyed.shape
    device = values.device
    sorted_ranks, order = torch.sort(ranks, stable=True)
    bounds = torch.empty(world_size + 1, dtype=torch.int64, device=device)
    block = _block()
    _rank_bounds_kernel[(triton.cdiv(world_size + 1, block),)](
        sorted_ranks, bounds, batch, world_size, BLOCK=block
    )
    out_lengths, out_offsets, src_starts, in_offsets, positions = _plan(
        keyed.reshape(-1),
        num_keys,
        batch,
        bounds=bounds,
        sorted_ranks=sorted_ranks,
        order=order,
        to_rank_major=True,
    )
    key_splits = torch.empty(world_size, num_keys, dtype=torch.int64, device=device)
    rank_splits = torch.zeros(world_size, dtype=torch.int64, device=device)
    if num_keys:
        # The kernel writes every entry: no zero fills to launch.
        rank_splits = torch.empty_like(rank_splits)
        sample_counts = torch.empty(world_size, dtype=torch.int64, device=device)
        _splits_kernel[(triton.cdiv(world_size * num_keys, block),)](
            bounds,
            out_offsets,
            key_splits,
            rank_splits,
            sample_counts,
            num_keys,
            world_size,
            BLOCK=block,
        )
    else:
        sample_counts = bounds[1:] - bounds[:-1]
    out = permute_segments(values, out_offsets, src_starts, in_offsets, positions)
    return Dispatched(out, out_lengths, rank_splits, key_splits, sample_counts, order)


def ranged_combine(
    values: torch.Tensor, lengths: torch.Tensor, ranks: torch.Tensor, num_keys: int
) -> Jagged:
    """Triton ``freescale_kernels.ranged_combine``."""
    check_ranks(ranks)
    batch = ranks.numel()
    if lengths.numel() != num_keys * batch:
        raise ValueError(f"expected {num_keys} x {batch} lengths, got {lengths.numel()}")
    sorted_ranks, order = torch.sort(ranks, stable=True)
    # Each rank's first sample and count come from searching the sorted ranks, so the world
    # size (ranks.max() + 1, a host sync) is never needed.
    out_lengths, out_offsets, src_starts, in_offsets, positions = _plan(
        lengths.reshape(-1).contiguous(),
        num_keys,
        batch,
        bounds=None,
        sorted_ranks=sorted_ranks,
        order=order,
        to_rank_major=False,
    )
    out = permute_segments(values, out_offsets, src_starts, in_offsets, positions)
    return Jagged(out, out_lengths.reshape(num_keys, batch))


def keyed_transpose(
    values: torch.Tensor,
    lengths: torch.Tensor,
    counts: torch.Tensor,
    num_keys: int,
    *,
    to_key_major: bool = True,
) -> Jagged:
    """Triton ``freescale_kernels.keyed_transpose``."""
    flat = lengths.reshape(-1).contiguous()
    total = num_samples(flat, num_keys) if num_keys else int(counts.sum())
    out_lengths, out_offsets, src_starts, in_offsets, positions = _plan(
        flat,
        num_keys,
        total,
        bounds=exclusive_cumsum(counts),
        sorted_ranks=None,
        order=None,
        to_rank_major=not to_key_major,
    )
    out = permute_segments(values, out_offsets, src_starts, in_offsets, positions)
    if to_key_major:
        out_lengths = out_lengths.reshape(num_keys, total)
    return Jagged(out, out_lengths)
