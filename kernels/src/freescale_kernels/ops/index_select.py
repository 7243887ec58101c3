"""Triton jagged index select: the runs of chosen samples, in every key, in the chosen order.

Forward: a plan gives each output run its length, source row and output row, then
``gather_segments`` copies. Up to ``_FUSED_MAX_KEYS`` keys the plan is ONE launch with one program
per key (the input running sum of its key, then the output running sum of its picks; the rows of
the keys before it are summed again by each program, ``O(F**2 * B)`` reads from L2 in all);
beyond, a plan kernel between torch running sums. The output size is one host sync unless the
caller passes ``output_size``.

Backward is a deterministic index-add. A sample selected ``k`` times receives ``k`` gradient
runs; instead of atomics (whose order, and so whose float rounding, changes run to run) every
input row sums its own contributions in output order, read through the CSR inverse of
``indices`` (a stable argsort). bf16/fp16 gradients accumulate in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freescale_kernels._backend import interpreting
from freescale_kernels.layout import JaggedTensor, as_rows, exclusive_cumsum, keyed_lengths
from freescale_kernels.ops.jagged_copy import (
    find_tile_segments,
    gather_segments,
    int64_buffers,
    tile_shape,
)
from freescale_kernels.tiles import TUNED, CopyTile

_BLOCK = 1024
_INTERPRETER_BLOCK = 1 << 14
_FUSED_MAX_KEYS = 32


# Counts stay runtime values even when 1 (see find_segment).
@triton.jit(do_not_specialize=["num_samples", "num_selected", "num_keys"])
def _fused_select_plan_kernel(
    in_lengths,
    in_offsets,
    indices,
    out_lengths,
    out_offsets,
    src_starts,
    num_samples,
    num_selected,
    num_keys,
    HAS_OFFSETS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    key = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    if not HAS_OFFSETS:
        # This key's input running sum, after the rows of the keys before it.
        before = tl.zeros([BLOCK], tl.int64)
        limit = key * num_samples
        at = 0
        while at < limit:
            at_lanes = at + lanes
            before += tl.load(in_lengths + at_lanes, mask=at_lanes < limit, other=0).to(tl.int64)
            at += BLOCK
        carry = tl.sum(before, 0)
        at = 0
        while at < num_samples:
            at_lanes = at + lanes
            live = at_lanes < num_samples
            size = tl.load(in_lengths + limit + at_lanes, mask=live, other=0).to(tl.int64)
            tl.store(in_offsets + limit + at_lanes, carry + tl.cumsum(size, 0) - size, mask=live)
            carry += tl.sum(size, 0)
            at += BLOCK
        tl.store(in_offsets + num_keys * num_samples, carry, mask=key == num_keys - 1)
        # The picks below read offsets this program wrote: make them visible to all its lanes.
        tl.debug_barrier()
    # Output rows of the keys before this one: their picks' lengths.
    before = tl.zeros([BLOCK], tl.int64)
    at = 0
    while at < num_selected:
        at_lanes = at + lanes
        live = at_lanes < num_selected
        picked = tl.load(indices + at_lanes, mask=live, other=0).to(tl.int64)
        k = 0
        while k < key:
            before += tl.load(in_lengths + k * num_samples + picked, mask=live, other=0).to(
                tl.int64
            )
            k += 1
        at += BLOCK
    carry = tl.sum(before, 0)
    at = 0
    while at < num_selected:
        at_lanes = at + lanes
        live = at_lanes < num_selected
        picked = tl.load(indices + at_lanes, mask=live, other=0).to(tl.int64)
        source = key * num_samples + picked
        size = tl.load(in_lengths + source, mask=live, other=0)
        wide = size.to(tl.int64)
        run = key * num_selected + at_lanes
        tl.store(out_lengths + run, size, mask=live)
        tl.store(src_starts + run, tl.load(in_offsets + source, mask=live, other=0), mask=live)
        tl.store(out_offsets + run, carry + tl.cumsum(wide, 0) - wide, mask=live)
        carry += tl.sum(wide, 0)
        at += BLOCK
    tl.store(out_offsets + num_keys * num_selected, carry, mask=key == num_keys - 1)


@triton.jit
def _select_plan_kernel(
    in_lengths,
    in_offsets,
    indices,
    out_lengths,
    src_starts,
    num_samples,
    num_selected,
    num_keys,
    BLOCK: tl.constexpr,
):
    runs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = runs < num_keys * num_selected
    key = runs // num_selected
    picked = tl.load(indices + runs % num_selected, mask=mask, other=0).to(tl.int64)
    src = key * num_samples + picked
    tl.store(out_lengths + runs, tl.load(in_lengths + src, mask=mask), mask=mask)
    tl.store(src_starts + runs, tl.load(in_offsets + src, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["num_runs"])
def _index_add_kernel(
    grad_out,
    grad_in,
    in_offsets,
    out_offsets,
    picks,
    pick_offsets,
    total_rows,
    num_samples,
    num_selected,
    num_runs,
    dim,
    ACC_F64: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    first_row = tl.program_id(0).to(tl.int64) * BLOCK_R
    last_row = tl.minimum(first_row + BLOCK_R, total_rows) - 1
    rows = first_row + tl.arange(0, BLOCK_R)
    row_mask = rows < total_rows
    run = find_tile_segments(in_offsets, num_runs, rows, first_row, last_row, row_mask)
    within = rows - tl.load(in_offsets + run, mask=row_mask, other=0).to(tl.int64)
    key = run // num_samples
    sample = run % num_samples
    first = tl.load(pick_offsets + sample, mask=row_mask, other=0)
    times = tl.load(pick_offsets + sample + 1, mask=row_mask, other=0) - first
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    acc_type = tl.float64 if ACC_F64 else tl.float32
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=acc_type)
    most = tl.max(times, axis=0)
    t = 0
    while t < most:
        live = row_mask & (t < times)
        pick = tl.load(picks + first + t, mask=live, other=0)
        src = tl.load(out_offsets + key * num_selected + pick, mask=live, other=0) + within
        mask = live[:, None] & col_mask[None, :]
        item = tl.load(grad_out + src[:, None] * dim + cols[None, :], mask=mask)
        acc += tl.where(mask, item.to(acc_type), 0.0)
        t += 1
    mask = row_mask[:, None] & col_mask[None, :]
    out = acc.to(grad_in.dtype.element_ty)
    tl.store(grad_in + rows[:, None] * dim + cols[None, :], out, mask=mask)


def _index_add(
    grad_out: torch.Tensor,
    in_offsets: torch.Tensor,
    out_offsets: torch.Tensor,
    indices: torch.Tensor,
    num_samples: int,
    total_rows: int,
    tile: CopyTile,
) -> torch.Tensor:
    """``[total_rows, D]``: for each input row, the sum of the output rows copied from it."""
    dim = grad_out.shape[1]
    num_runs = in_offsets.numel() - 1
    grad_in = torch.empty(total_rows, dim, dtype=grad_out.dtype, device=grad_out.device)
    if total_rows == 0 or dim == 0:
        return grad_in
    picks = torch.argsort(indices, stable=True)
    pick_offsets = exclusive_cumsum(torch.bincount(indices, minlength=num_samples))
    block_r, block_d = tile_shape(dim, grad_out.element_size(), tile)
    grid = (triton.cdiv(total_rows, block_r), triton.cdiv(dim, block_d))
    _index_add_kernel[grid](
        grad_out,
        grad_in,
        in_offsets,
        out_offsets,
        picks,
        pick_offsets,
        total_rows,
        num_samples,
        indices.numel(),
        num_runs,
        dim,
        ACC_F64=grad_out.dtype == torch.float64,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
    )
    return grad_in


class JaggedIndexSelect(torch.autograd.Function):
    """Copies the selected runs; the backward sums gradients of repeated picks in output order."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        values: torch.Tensor,
        in_offsets: torch.Tensor,
        out_offsets: torch.Tensor,
        src_starts: torch.Tensor,
        indices: torch.Tensor,
        num_samples: int,
        output_size: int,
        tile: CopyTile,
    ) -> torch.Tensor:
        ctx.save_for_backward(in_offsets, out_offsets, indices)
        ctx.num_samples = num_samples
        ctx.in_shape = values.shape
        ctx.tile = tile
        rows = as_rows(values)
        out = gather_segments(rows, out_offsets, src_starts, output_size, tile=tile)
        return out.reshape(output_size, *values.shape[1:])

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        in_offsets, out_offsets, indices = ctx.saved_tensors
        rows = as_rows(grad)
        grad_in = _index_add(
            rows, in_offsets, out_offsets, indices, ctx.num_samples, ctx.in_shape[0], ctx.tile
        )
        return grad_in.reshape(ctx.in_shape), None, None, None, None, None, None, None


def plan_select(
    flat: torch.Tensor,
    num_keys: int,
    batch: int,
    index: torch.Tensor,
    offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(in_offsets, out_lengths, out_offsets, src_starts) of a select of int64 ``index``."""
    device = flat.device
    runs = num_keys * index.numel()
    out_lengths = torch.empty(runs, dtype=flat.dtype, device=device)
    if 0 < num_keys <= _FUSED_MAX_KEYS:
        size = [runs + 1, runs]
        if offsets is None:
            size.append(flat.numel() + 1)
        buffers = int64_buffers(device, *size)
        out_offsets, src_starts = buffers[:2]
        in_offsets = buffers[2] if offsets is None else offsets.reshape(-1).contiguous()
        _fused_select_plan_kernel[(num_keys,)](
            flat,
            in_offsets,
            index,
            out_lengths,
            out_offsets,
            src_starts,
            batch,
            index.numel(),
            num_keys,
            HAS_OFFSETS=offsets is not None,
            BLOCK=_INTERPRETER_BLOCK if interpreting() else _BLOCK,
        )
        return in_offsets, out_lengths, out_offsets, src_starts
    in_offsets = exclusive_cumsum(flat) if offsets is None else offsets.reshape(-1).contiguous()
    src_starts = torch.empty(runs, dtype=torch.int64, device=device)
    if runs:
        block = _INTERPRETER_BLOCK if interpreting() else _BLOCK
        _select_plan_kernel[(triton.cdiv(runs, block),)](
            flat,
            in_offsets,
            index,
            out_lengths,
            src_starts,
            batch,
            index.numel(),
            num_keys,
            BLOCK=block,
        )
    return in_offsets, out_lengths, exclusive_cumsum(out_lengths), src_starts


def jagged_index_select(
    values: torch.Tensor,
    lengths: torch.Tensor,
    indices: torch.Tensor,
    *,
    offsets: torch.Tensor | None = None,
    output_size: int | None = None,
    tile: CopyTile = TUNED.copy,
) -> JaggedTensor:
    """Triton ``freescale_kernels.jagged_index_select`` (indices are not range-checked)."""
    keyed = keyed_lengths(lengths)
    num_keys, batch = keyed.shape
    flat = keyed.reshape(-1)
    index = indices.reshape(-1).to(torch.int64).contiguous()
    in_offsets, out_lengths, out_offsets, src_starts = plan_select(
        flat, num_keys, batch, index, offsets
    )
    if output_size is None:
        output_size = int(out_offsets[-1])
    if values.requires_grad and torch.is_grad_enabled():
        out = JaggedIndexSelect.apply(
            values, in_offsets, out_offsets, src_starts, index, batch, output_size, tile
        )
    else:
        rows = as_rows(values)
        out = gather_segments(rows, out_offsets, src_starts, output_size, tile=tile)
        out = out.reshape(output_size, *values.shape[1:])
    shaped = out_lengths.reshape(num_keys, index.numel()) if lengths.dim() == 2 else out_lengths
    return JaggedTensor(out, shaped)
