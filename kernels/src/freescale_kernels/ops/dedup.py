"""Triton deterministic helpers for embedding lookups: unique IDs with inverse, segment sums.

``unique_with_inverse`` sorts with ``torch.sort(stable=True)`` (CUB's radix sort: exact and
deterministic for integers), then two kernels around one running sum mark run starts and scatter
the unique IDs, the run offsets and the inverse. The number of unique IDs is one host sync: the
output sizes depend on it.

``segment_sum`` gives each group of ``SEGS`` consecutive segments (and column tile) to one
program, which walks the segments' rows ``BLOCK_R`` at a time, accumulating element-wise in
float32 (float64 for float64, int64 for integers) and reducing over ``BLOCK_R`` once at the end.
Short segments (the usual case: a few repeats of an ID) share a program, so every load carries
rows of several segments; long ones get one program and taller tiles. The order of every
addition depends only on the segment layout and the tile shape (chosen from the input's shape),
never on scheduling or atomics, so the result is bitwise the same run to run on the same device
and build.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freescale_kernels._backend import interpreting
from freescale_kernels.layout import UniqueResult, as_rows
from freescale_kernels.ops.reference import segment_offsets
from freescale_kernels.tiles import TUNED, SumTile

_BLOCK = 1024
_INTERPRETER_BLOCK = 1 << 14
_INTERPRETER_SUM_TILE_ELEMENTS = 1 << 14
_SUM_MAX_BLOCK_D = 128
_SUM_MAX_SEGS = 64


@triton.jit
def _run_starts_kernel(sorted_ids, starts, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    here = tl.load(sorted_ids + i, mask=mask, other=0)
    before = tl.load(sorted_ids + i - 1, mask=mask & (i > 0), other=0)
    tl.store(starts + i, ((i == 0) | (here != before)).to(tl.int64), mask=mask)


@triton.jit
def _unique_scatter_kernel(
    sorted_ids,
    order,
    starts,
    run_ids,
    unique,
    inverse,
    offsets,
    n,
    num_unique,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    run = tl.load(run_ids + i, mask=mask, other=1) - 1
    tl.store(inverse + tl.load(order + i, mask=mask, other=0), run, mask=mask)
    first = mask & (tl.load(starts + i, mask=mask, other=0) != 0)
    tl.store(unique + run, tl.load(sorted_ids + i, mask=mask), mask=first)
    tl.store(offsets + run, i, mask=first)
    # The end of the last run, stored by one lane: cheaper than a separate one-element fill.
    tl.store(offsets + num_unique + i * 0, i * 0 + n, mask=i == 0)


def unique_with_inverse(ids: torch.Tensor) -> UniqueResult:
    """Triton ``freescale_kernels.unique_with_inverse``."""
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    n = ids.numel()
    device = ids.device
    sorted_ids, order = torch.sort(ids, stable=True)
    if n == 0:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        return UniqueResult(sorted_ids, empty, empty, zero, order)
    block = _INTERPRETER_BLOCK if interpreting() else _BLOCK
    grid = (triton.cdiv(n, block),)
    starts = torch.empty(n, dtype=torch.int64, device=device)
    _run_starts_kernel[grid](sorted_ids, starts, n, BLOCK=block)
    run_ids = torch.cumsum(starts, 0)
    num_unique = int(run_ids[-1])
    unique = torch.empty(num_unique, dtype=ids.dtype, device=device)
    inverse = torch.empty(n, dtype=torch.int64, device=device)
    offsets = torch.empty(num_unique + 1, dtype=torch.int64, device=device)
    _unique_scatter_kernel[grid](
        sorted_ids, order, starts, run_ids, unique, inverse, offsets, n, num_unique, BLOCK=block
    )
    return UniqueResult(unique, inverse, offsets[1:] - offsets[:-1], offsets, order)


@triton.jit(do_not_specialize=["num_segments"])
def _segment_sum_kernel(
    values,
    out,
    offsets,
    order,
    num_segments,
    dim,
    HAS_ORDER: tl.constexpr,
    ACC: tl.constexpr,
    SEGS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    segment = tl.program_id(0).to(tl.int64) * SEGS + tl.arange(0, SEGS)
    seg_mask = segment < num_segments
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    start = tl.load(offsets + segment, mask=seg_mask, other=0).to(tl.int64)
    length = tl.load(offsets + segment + 1, mask=seg_mask, other=0).to(tl.int64) - start
    most = tl.max(length, axis=0)
    acc = tl.zeros([SEGS, BLOCK_R, BLOCK_D], dtype=ACC)
    step = tl.arange(0, BLOCK_R)
    done = 0
    while done < most:
        live = (done + step)[None, :] < length[:, None]  # [SEGS, BLOCK_R]
        rows = start[:, None] + done + step[None, :]
        if HAS_ORDER:
            rows = tl.load(order + rows, mask=live, other=0).to(tl.int64)
        mask = live[:, :, None] & col_mask[None, None, :]
        item = tl.load(values + rows[:, :, None] * dim + cols[None, None, :], mask=mask)
        acc += tl.where(mask, item.to(ACC), 0)
        done += BLOCK_R
    total = tl.sum(acc, axis=1)
    target = out + segment[:, None] * dim + cols[None, :]
    tl.store(target, total.to(out.dtype.element_ty), mask=seg_mask[:, None] & col_mask[None, :])


def _sum_tile(rows: int, num_segments: int, dim: int, tile: SumTile) -> tuple[int, int, int]:
    """(segments per program, rows per step, columns) from the mean segment length."""
    elements = _INTERPRETER_SUM_TILE_ELEMENTS if interpreting() else tile.elements
    block_d = min(triton.next_power_of_2(dim), _SUM_MAX_BLOCK_D)
    tall = max(elements // block_d, 1)
    mean = rows // max(num_segments, 1)
    # Rows per step: the mean length rounded down to a power of two (a step then rarely runs
    # half empty), up to the full tile for long segments; the rest of the tile is segments.
    block_r = min(1 << (max(mean, 1).bit_length() - 1), tall)
    segs = min(max(tall // block_r, 1), _SUM_MAX_SEGS, triton.next_power_of_2(num_segments))
    return segs, block_r, block_d


def _accumulator(dtype: torch.dtype) -> tl.dtype:
    if dtype == torch.float64:
        return tl.float64
    if dtype.is_floating_point:
        return tl.float32
    return tl.int64


class SegmentSum(torch.autograd.Function):
    """Deterministic segment sums; the backward hands each row its segment's gradient."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        values: torch.Tensor,
        offsets: torch.Tensor,
        order: torch.Tensor | None,
        tile: SumTile,
    ) -> torch.Tensor:
        ctx.save_for_backward(offsets, order)
        ctx.in_shape = values.shape
        rows = as_rows(values)
        num_segments = offsets.numel() - 1
        dim = rows.shape[1]
        out = torch.empty(num_segments, dim, dtype=values.dtype, device=values.device)
        if num_segments and dim:
            summed = rows.shape[0] if order is None else order.numel()
            segs, block_r, block_d = _sum_tile(summed, num_segments, dim, tile)
            _segment_sum_kernel[(triton.cdiv(num_segments, segs), triton.cdiv(dim, block_d))](
                rows,
                out,
                offsets,
                order if order is not None else offsets,
                num_segments,
                dim,
                HAS_ORDER=order is not None,
                ACC=_accumulator(values.dtype),
                SEGS=segs,
                BLOCK_R=block_r,
                BLOCK_D=block_d,
                num_warps=1 if interpreting() else tile.warps,
            )
        return out.reshape(num_segments, *values.shape[1:])

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        offsets, order = ctx.saved_tensors
        summed_rows = ctx.in_shape[0] if order is None else order.numel()
        segment_of_row = torch.repeat_interleave(
            torch.arange(offsets.numel() - 1, device=grad.device),
            offsets[1:] - offsets[:-1],
            output_size=summed_rows,
        )
        per_row = grad.index_select(0, segment_of_row)
        if order is None:
            return per_row, None, None, None
        grad_in = per_row.new_zeros(ctx.in_shape)
        grad_in.index_copy_(0, order, per_row)
        return grad_in, None, None, None


def segment_sum(
    values: torch.Tensor,
    offsets: torch.Tensor | None = None,
    *,
    segment_ids: torch.Tensor | None = None,
    num_segments: int | None = None,
    order: torch.Tensor | None = None,
    tile: SumTile = TUNED.segment_sum,
) -> torch.Tensor:
    """Triton ``freescale_kernels.segment_sum`` (offsets are not range-checked)."""
    offsets = segment_offsets(offsets, segment_ids, num_segments).contiguous()
    if order is not None:
        order = order.to(torch.int64).contiguous()
    return SegmentSum.apply(values, offsets, order, tile)
