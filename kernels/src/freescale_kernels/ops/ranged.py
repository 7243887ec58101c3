"""Triton ranged dispatch / combine and keyed transpose: rank-major <-> key-major jagged layouts.

All three move key ``f``'s run of the ``c``-th sample (samples grouped by rank) between its
key-major slot ``f * B + sample`` and its rank-major slot

    ``p = F * start[r] + f * count[r] + (c - start[r])``

where ``r`` is the sample's rank, ``start[r]`` the first sample of rank ``r`` and ``count[r]``
its sample count. A plan gives every output run its length, its first output row (a running
sum in output order) and its first source row (a running sum in input order); the rows then move
with one ``gather_segments`` copy. Nothing depends on the world size beyond ``O(W)`` split sizes,
and nothing syncs with the host: the output has as many rows as the input.

Two planners:

* fused (up to ``_FUSED_MAX_SAMPLES`` samples and ``_FUSED_MAX_KEYS`` keys, the common case): ONE
  launch, one program per key. Every program holds all samples in registers, in rank order: each
  sample's rank block comes from its neighbours in the sorted ranks (dispatch, combine) or from
  the rank sizes (transpose), and both running sums are register scans with gathers, because

      out_row(f, c) = R[start] + (P[end] - P[start]) + (S[c] - S[start])

  where ``R``, ``P`` and ``S`` are running sums over the rank-ordered samples of their rows in all
  keys, in the keys before ``f`` and in key ``f``. So dispatch is ``sort_ranks`` (a narrowing
  cast and ``torch.sort``), this plan and the copy; the first version launched four Triton
  kernels and four torch running-sum ops besides the sort. Measured on one H200 (torch.profiler,
  4096 samples, 4 keys, W=512): plan 23.6 us, sort 16.1 us, copy 90 us (ids-large).
* multi-launch (larger inputs): a plan kernel over runs with torch running sums around it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from freescale_kernels._backend import interpreting
from freescale_kernels.layout import (
    Dispatched,
    JaggedTensor,
    check_ranks,
    check_world_size,
    exclusive_cumsum,
    keyed_lengths,
    num_samples,
)
from freescale_kernels.ops.jagged_copy import (
    find_segment,
    int64_buffers,
    lower_bound,
    permute_segments,
)
from freescale_kernels.tiles import TUNED, CopyTile

# The fused planner keeps ``next_power_of_2(samples)`` samples of a few int32 quantities per
# program in registers; 4096 samples over 16 warps is 8 per lane, which ptxas on sm_90 fits
# without spills. Each program reads every key's lengths once (``O(F**2 * B)`` in all, from L2),
# which stays small next to the copy up to a few dozen keys.
_FUSED_MAX_SAMPLES = 4096
_FUSED_MAX_KEYS = 32
_RANK_BLOCK = 1024


class LayoutPlan(NamedTuple):
    """Where every run goes: what ``move`` needs, and its backward.

    Attributes:
        out_lengths: run lengths in output order (the lengths' dtype).
        out_offsets: int64 ``[R + 1]``, first output row of each output run.
        src_starts: int64 ``[R]``, first source row of each output run.
        in_offsets: int64 ``[R + 1]``, first row of each input run.
        positions: int64 ``[R]``, the output run of each input run.
    """

    out_lengths: torch.Tensor
    out_offsets: torch.Tensor
    src_starts: torch.Tensor
    in_offsets: torch.Tensor
    positions: torch.Tensor


def move(values: torch.Tensor, plan: LayoutPlan, tile: CopyTile = TUNED.copy) -> torch.Tensor:
    """The rows of ``values`` in the plan's output order (differentiable)."""
    return permute_segments(
        values, plan.out_offsets, plan.src_starts, plan.in_offsets, plan.positions, tile
    )


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit
def _last_at_most(values, n, targets, mask):
    """Largest ``i`` in ``[0, n)`` with ``values[i] <= target`` (``values`` non-decreasing,
    ``values[0] <= target``); int32 search state."""
    lo = tl.zeros_like(targets)
    hi = lo + n
    width = tl.full([], n, tl.int32)
    while width > 1:
        mid = (lo + hi) // 2
        right = tl.load(values + mid, mask=mask, other=0) <= targets
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
        width = (width + 1) // 2
    return lo


# Key, sample and rank counts stay runtime values even when 1 (see find_segment).
@triton.jit(do_not_specialize=["num_keys", "num_samples", "world_size"])
def _fused_plan_kernel(
    lengths,
    sorted_ranks,
    order,
    counts,
    bounds,
    out_lengths,
    out_offsets,
    src_starts,
    in_offsets,
    positions,
    key_splits,
    rank_splits,
    sample_counts,
    num_keys,
    num_samples,
    world_size,
    HAS_ORDER: tl.constexpr,
    TO_RANK_MAJOR: tl.constexpr,
    SPLITS: tl.constexpr,
    SB: tl.constexpr,
    RB: tl.constexpr,
    OFF: tl.constexpr,
):
    key = tl.program_id(0)
    c = tl.arange(0, SB)  # samples in rank order
    valid = c < num_samples
    # Each sample's rank block [start, end) in rank order.
    if HAS_ORDER:
        rank = tl.load(sorted_ranks + c, mask=valid, other=0)
        before = tl.load(sorted_ranks + c - 1, mask=valid & (c > 0), other=0)
        after = tl.load(sorted_ranks + c + 1, mask=c + 1 < num_samples, other=0)
        first = valid & ((c == 0) | (rank != before))
        final = valid & ((c + 1 == num_samples) | (rank != after))
        lead = first & (rank >= 0) & (rank < world_size)  # ranks are not range-checked
        rank = rank.to(tl.int32)  # only addresses the split sizes below, under ``lead``
        start = tl.associative_scan(tl.where(first, c, 0), 0, _max_combine)
        end = tl.associative_scan(tl.where(final, c + 1, SB), 0, _min_combine, reverse=True)
        sample = tl.load(order + c, mask=valid, other=0).to(tl.int32)
    else:
        # This program's own copy of the rank bounds (no other program writes it).
        mine = bounds + key * (world_size + 1)
        carry = tl.full([], 0, tl.int64)
        r0 = 0
        while r0 < world_size:
            r = r0 + tl.arange(0, RB)
            in_range = r < world_size
            size = tl.load(counts + r, mask=in_range, other=0).to(tl.int64)
            tl.store(mine + r + 1, carry + tl.cumsum(size, 0), mask=in_range)
            carry += tl.sum(size, 0)
            r0 += RB
        tl.store(mine, carry * 0)
        tl.debug_barrier()
        rank = _last_at_most(mine, world_size, c, valid)
        start = tl.load(mine + rank, mask=valid, other=0).to(tl.int32)
        end = tl.load(mine + rank + 1, mask=valid, other=0).to(tl.int32)
        sample = c
    count = end - start
    # Every key's lengths in rank order: all keys (R), keys before this one (P), this one (S).
    every = tl.zeros([SB], OFF)
    earlier = tl.zeros([SB], OFF)
    own = tl.zeros([SB], OFF)
    k = 0
    while k < num_keys:
        if TO_RANK_MAJOR:
            run = k * num_samples + sample
        else:
            run = num_keys * start + k * count + (c - start)
        size = tl.load(lengths + run, mask=valid, other=0).to(OFF)
        every += size
        earlier += tl.where(k < key, size, 0)
        own = tl.where(k == key, size, own)
        k += 1
    every_sum = tl.cumsum(every, 0) - every
    earlier_sum = tl.cumsum(earlier, 0) - earlier
    own_sum = tl.cumsum(own, 0) - own
    total = tl.sum(every, 0)
    base = tl.sum(earlier, 0)  # rows of the keys before this one
    inside = end < SB  # ``end == SB`` only when all SB slots are samples: the running sum ends
    clamped = tl.minimum(end, SB - 1)
    earlier_end = tl.where(inside, tl.gather(earlier_sum, clamped, 0), base)
    rank_major = tl.gather(every_sum - earlier_sum - own_sum, start, 0) + earlier_end + own_sum
    slot = num_keys * start + key * count + (c - start)
    key_major = key * num_samples + sample
    if TO_RANK_MAJOR:
        if HAS_ORDER:
            plain = tl.load(lengths + key * num_samples + c, mask=valid, other=0).to(OFF)
            key_sum = base + tl.cumsum(plain, 0) - plain
            source = tl.gather(key_sum, sample, 0)
        else:
            key_sum = base + own_sum
            source = key_sum
        tl.store(out_lengths + slot, own, mask=valid)
        tl.store(out_offsets + slot, rank_major, mask=valid)
        tl.store(src_starts + slot, source, mask=valid)
        tl.store(in_offsets + key * num_samples + c, key_sum, mask=valid)
        tl.store(positions + key_major, slot, mask=valid)
    else:
        tl.store(in_offsets + slot, rank_major, mask=valid)
        tl.store(positions + slot, key_major, mask=valid)
        tl.store(src_starts + key_major, rank_major, mask=valid)
        tl.store(out_lengths + key_major, own, mask=valid)
        if HAS_ORDER:
            # The output running sum goes in sample order: read back what this program just
            # scattered (the barrier makes a program's global writes visible to all its lanes).
            tl.debug_barrier()
            plain = tl.load(out_lengths + key * num_samples + c, mask=valid, other=0).to(OFF)
            key_sum = base + tl.cumsum(plain, 0) - plain
        else:
            key_sum = base + own_sum
        tl.store(out_offsets + key * num_samples + c, key_sum, mask=valid)
    last = key == num_keys - 1
    tl.store(out_offsets + num_keys * num_samples, total, mask=last)
    tl.store(in_offsets + num_keys * num_samples, total, mask=last)
    if SPLITS:
        # Ranks without samples get zeros: clear this key's column, then write the ranks present.
        r0 = 0
        while r0 < world_size:
            r = r0 + tl.arange(0, RB)
            in_range = r < world_size
            tl.store(key_splits + r * num_keys + key, 0, mask=in_range)
            tl.store(rank_splits + r, 0, mask=in_range & (key == 0))
            tl.store(sample_counts + r, 0, mask=in_range & (key == 0))
            r0 += RB
        tl.debug_barrier()
        own_end = tl.where(inside, tl.gather(own_sum, clamped, 0), tl.sum(own, 0))
        tl.store(key_splits + rank * num_keys + key, own_end - own_sum, mask=lead)
        every_end = tl.where(inside, tl.gather(every_sum, clamped, 0), total)
        tl.store(rank_splits + rank, every_end - every_sum, mask=lead & (key == 0))
        tl.store(sample_counts + rank, count, mask=lead & (key == 0))


def sort_ranks(ranks: torch.Tensor, world_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted ranks, stable order) with the ranks sorted as the narrowest integers that hold
    them. ``torch.sort`` radix-sorts every bit of the key type, so narrower keys sort faster
    (``benchmarks/results/kernels/NOTES.md``, "Rank sort"). Ranks below ``world_size`` (or,
    without it, process ranks: below 2**31) keep their order, and the sort is stable, so the
    order is the same."""
    if world_size is not None and world_size <= 256 and ranks.dtype != torch.uint8:
        ranks = ranks.to(torch.uint8)
    elif world_size is not None and world_size <= 2**15 and ranks.dtype.itemsize > 2:
        ranks = ranks.to(torch.int16)
    elif ranks.dtype.itemsize > 4:
        ranks = ranks.to(torch.int32)
    return torch.sort(ranks, stable=True)


def _fused(num_keys: int, batch: int) -> bool:
    return 0 < num_keys <= _FUSED_MAX_KEYS and 0 < batch <= _FUSED_MAX_SAMPLES


def _fused_plan(
    flat_lengths: torch.Tensor,
    num_keys: int,
    batch: int,
    total_rows: int,
    *,
    sorted_ranks: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    to_rank_major: bool,
    world_size: int = 0,
    splits: bool = False,
) -> tuple[LayoutPlan, list[torch.Tensor]]:
    """The fused planner (one launch); also the split sizes when ``splits``."""
    runs = num_keys * batch
    device = flat_lengths.device
    has_order = order is not None
    if not has_order:
        world_size = counts.numel()
    sizes = [runs + 1, runs, runs + 1, runs]
    if splits:
        sizes += [world_size * num_keys, world_size, world_size]
    if not has_order:
        sizes.append(num_keys * (world_size + 1))
    buffers = int64_buffers(device, *sizes)
    out_offsets, src_starts, in_offsets, positions = buffers[:4]
    out_lengths = torch.empty(runs, dtype=flat_lengths.dtype, device=device)
    block = triton.next_power_of_2(batch)
    placeholder = out_offsets  # never read: the matching flag is off
    _fused_plan_kernel[(num_keys,)](
        flat_lengths,
        sorted_ranks if has_order else placeholder,
        order if has_order else placeholder,
        counts if not has_order else placeholder,
        buffers[-1] if not has_order else placeholder,
        out_lengths,
        out_offsets,
        src_starts,
        in_offsets,
        positions,
        *(buffers[4:7] if splits else (placeholder,) * 3),
        num_keys,
        batch,
        world_size,
        HAS_ORDER=has_order,
        TO_RANK_MAJOR=to_rank_major,
        SPLITS=splits,
        SB=block,
        RB=_RANK_BLOCK,
        OFF=tl.int32 if total_rows < 2**31 else tl.int64,
        num_warps=1 if interpreting() else min(max(block // 256, 4), 16),
    )
    plan = LayoutPlan(out_lengths, out_offsets, src_starts, in_offsets, positions)
    return plan, buffers[4:7] if splits else []


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
) -> LayoutPlan:
    """The multi-launch planner: the plan of one layout change.

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
    return LayoutPlan(out_lengths, exclusive_cumsum(out_lengths), src_starts, in_offsets, positions)


def plan_dispatch(
    lengths: torch.Tensor, ranks: torch.Tensor, world_size: int, total_rows: int
) -> tuple[LayoutPlan, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(plan, key_splits ``[W, F]``, rank_splits, sample_counts, order) of a dispatch."""
    check_world_size(world_size)
    check_ranks(ranks)
    keyed = keyed_lengths(lengths)
    num_keys, batch = keyed.shape
    device = keyed.device
    sorted_ranks, order = sort_ranks(ranks, world_size)
    if _fused(num_keys, batch):
        plan, (key_splits, rank_splits, sample_counts) = _fused_plan(
            keyed.reshape(-1),
            num_keys,
            batch,
            total_rows,
            sorted_ranks=sorted_ranks,
            order=order,
            to_rank_major=True,
            world_size=world_size,
            splits=True,
        )
        return plan, key_splits.view(world_size, num_keys), rank_splits, sample_counts, order
    bounds = torch.empty(world_size + 1, dtype=torch.int64, device=device)
    block = _block()
    _rank_bounds_kernel[(triton.cdiv(world_size + 1, block),)](
        sorted_ranks, bounds, batch, world_size, BLOCK=block
    )
    plan = _plan(
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
            plan.out_offsets,
            key_splits,
            rank_splits,
            sample_counts,
            num_keys,
            world_size,
            BLOCK=block,
        )
    else:
        sample_counts = bounds[1:] - bounds[:-1]
    return plan, key_splits, rank_splits, sample_counts, order


def plan_combine(
    lengths: torch.Tensor, ranks: torch.Tensor, num_keys: int, total_rows: int
) -> LayoutPlan:
    """The plan of a ``ranged_combine`` (``lengths`` flat rank-major)."""
    check_ranks(ranks)
    batch = ranks.numel()
    if lengths.numel() != num_keys * batch:
        raise ValueError(f"expected {num_keys} x {batch} lengths, got {lengths.numel()}")
    flat = lengths.reshape(-1).contiguous()
    sorted_ranks, order = sort_ranks(ranks, None)
    if _fused(num_keys, batch):
        return _fused_plan(
            flat,
            num_keys,
            batch,
            total_rows,
            sorted_ranks=sorted_ranks,
            order=order,
            to_rank_major=False,
        )[0]
    # Each rank's first sample and count come from searching the sorted ranks, so the world
    # size (ranks.max() + 1, a host sync) is never needed.
    return _plan(
        flat,
        num_keys,
        batch,
        bounds=None,
        sorted_ranks=sorted_ranks,
        order=order,
        to_rank_major=False,
    )


def plan_transpose(
    lengths: torch.Tensor,
    counts: torch.Tensor,
    num_keys: int,
    total_rows: int,
    *,
    to_key_major: bool,
) -> tuple[LayoutPlan, int]:
    """(plan, samples) of a ``keyed_transpose``."""
    flat = lengths.reshape(-1).contiguous()
    total = num_samples(flat, num_keys) if num_keys else int(counts.sum())
    if _fused(num_keys, total):
        plan, _ = _fused_plan(
            flat,
            num_keys,
            total,
            total_rows,
            counts=counts.contiguous(),
            to_rank_major=not to_key_major,
        )
        return plan, total
    plan = _plan(
        flat,
        num_keys,
        total,
        bounds=exclusive_cumsum(counts),
        sorted_ranks=None,
        order=None,
        to_rank_major=not to_key_major,
    )
    return plan, total


def ranged_dispatch(
    values: torch.Tensor,
    lengths: torch.Tensor,
    ranks: torch.Tensor,
    world_size: int,
    tile: CopyTile = TUNED.copy,
) -> Dispatched:
    """Triton ``freescale_kernels.ranged_dispatch`` (ranks are not range-checked)."""
    plan, key_splits, rank_splits, sample_counts, order = plan_dispatch(
        lengths, ranks, world_size, values.shape[0]
    )
    out = move(values, plan, tile)
    return Dispatched(out, plan.out_lengths, rank_splits, key_splits, sample_counts, order)


def ranged_combine(
    values: torch.Tensor,
    lengths: torch.Tensor,
    ranks: torch.Tensor,
    num_keys: int,
    tile: CopyTile = TUNED.copy,
) -> JaggedTensor:
    """Triton ``freescale_kernels.ranged_combine``."""
    plan = plan_combine(lengths, ranks, num_keys, values.shape[0])
    out = move(values, plan, tile)
    return JaggedTensor(out, plan.out_lengths.reshape(num_keys, ranks.numel()))


def keyed_transpose(
    values: torch.Tensor,
    lengths: torch.Tensor,
    counts: torch.Tensor,
    num_keys: int,
    *,
    to_key_major: bool = True,
    tile: CopyTile = TUNED.copy,
) -> JaggedTensor:
    """Triton ``freescale_kernels.keyed_transpose``."""
    plan, total = plan_transpose(
        lengths, counts, num_keys, values.shape[0], to_key_major=to_key_major
    )
    out = move(values, plan, tile)
    out_lengths = plan.out_lengths
    if to_key_major:
        out_lengths = out_lengths.reshape(num_keys, total)
    return JaggedTensor(out, out_lengths)
