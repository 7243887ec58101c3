"""The copy every jagged operation ends with: concatenate runs of rows, read from anywhere.

Output row ``o`` belongs to output run ``i`` with ``out_offsets[i] <= o < out_offsets[i + 1]``
and reads row ``src_starts[i] + (o - out_offsets[i])`` of the source. Programs own fixed tiles of
output rows and find each row's run by binary search, so the grid depends only on the rows moved:
no host sync for the longest run, the same work per program whatever the run lengths (one huge
sample included), and nothing proportional to the number of ranks.

Also here: the search helpers the other kernels share, and ``SegmentPermute``, the autograd
function of every operation that moves each input run to exactly one output run (dispatch,
combine, transpose): its backward is the same copy with the roles of the two layouts swapped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freescale_kernels._backend import interpreting
from freescale_kernels.layout import as_rows

# Tile sizes: without a GPU at hand these follow ptxas (sm_90, 4 warps) on the compiled kernel,
# not a timing. The per-row search state dominates registers: 1024 rows per program use 56
# registers, 2048 use 106 and 4096 use 202, which would cap occupancy. So at most 1024 rows, and
# about 8 KiB of items per program, which keeps 64 bytes in flight per thread for 8-byte items.
# The interpreter runs programs one after another in Python, so it gets few, large tiles.
_MAX_BLOCK_R = 1024
_TILE_BYTES = 8192
_INTERPRETER_TILE_ELEMENTS = 1 << 16
_MAX_BLOCK_D = 256


def tile_shape(dim: int, item_bytes: int) -> tuple[int, int]:
    """(rows, columns) of one program's tile for rows of ``dim`` items of ``item_bytes``."""
    block_d = min(triton.next_power_of_2(max(dim, 1)), _MAX_BLOCK_D)
    if interpreting():
        return max(_INTERPRETER_TILE_ELEMENTS // block_d, 1), block_d
    block_r = min(max(_TILE_BYTES // (item_bytes * block_d), 1), _MAX_BLOCK_R)
    return triton.next_power_of_2(block_r), block_d


@triton.jit
def find_segment(offsets, lo, hi, width, targets, mask):
    """Index ``i`` of the run holding each target: ``offsets[i] <= t < offsets[i + 1]``.

    ``offsets`` is non-decreasing; the caller guarantees ``offsets[lo] <= t < offsets[hi]`` and
    ``hi - lo <= width`` (a scalar), so the search takes ``log2(width)`` steps. Runs of length 0
    are never returned. Works on scalar and block targets alike.
    """
    lo = tl.zeros_like(targets) + lo
    hi = tl.zeros_like(targets) + hi
    # Kernels pass search widths with do_not_specialize: a width Triton turned into the constant
    # 1 compiles to a loop that sm_90 LLVM asserts on (Triton 3.6).
    width = tl.full([], width, tl.int64)
    # A while loop: Triton 3.6's interpreter cannot take a runtime bound in range() with NumPy 2.4.
    while width > 1:
        mid = (lo + hi) // 2
        right = tl.load(offsets + mid, mask=mask, other=0).to(tl.int64) <= targets
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
        width = (width + 1) // 2
    return lo


@triton.jit
def find_tile_segments(offsets, num_segments, rows, first, last, mask):
    """``find_segment`` for a tile of consecutive rows ``first..last``: the tile's first and last
    rows are searched once over all runs (uniform loads), then each row only among the runs the
    tile spans, which for long runs is one or two."""
    seg_first = find_segment(offsets, 0, num_segments, num_segments, first, first >= 0)
    seg_last = find_segment(offsets, 0, num_segments, num_segments, last, last >= 0)
    return find_segment(offsets, seg_first, seg_last + 1, seg_last + 1 - seg_first, rows, mask)


@triton.jit
def lower_bound(sorted_values, n, targets, mask):
    """First index ``i`` in ``[0, n]`` with ``sorted_values[i] >= target``."""
    lo = tl.zeros_like(targets)
    hi = tl.zeros_like(targets) + n
    width = tl.full([], n, tl.int64)
    while width > 0:
        open_ = mask & (lo < hi)
        mid = (lo + hi) // 2
        below = tl.load(sorted_values + mid, mask=open_, other=0).to(tl.int64) < targets
        lo = tl.where(open_ & below, mid + 1, lo)
        hi = tl.where(open_ & ~below, mid, hi)
        width = width // 2
    return lo


# A run count of 1 must not become a constant: the search loop carries it (see find_segment).
@triton.jit(do_not_specialize=["num_segments"])
def _gather_segments_kernel(
    src,
    dst,
    out_offsets,
    src_starts,
    num_segments,
    total_rows,
    dim,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    first = tl.program_id(0).to(tl.int64) * BLOCK_R
    last = tl.minimum(first + BLOCK_R, total_rows) - 1
    rows = first + tl.arange(0, BLOCK_R)
    row_mask = rows < total_rows
    segment = find_tile_segments(out_offsets, num_segments, rows, first, last, row_mask)
    run_start = tl.load(out_offsets + segment, mask=row_mask, other=0).to(tl.int64)
    src_rows = tl.load(src_starts + segment, mask=row_mask, other=0).to(tl.int64)
    src_rows += rows - run_start
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = row_mask[:, None] & (cols < dim)[None, :]
    # No ``other=``: the interpreter cannot build bf16 constants, and masked lanes are not stored.
    item = tl.load(src + src_rows[:, None] * dim + cols[None, :], mask=mask)
    tl.store(dst + rows[:, None] * dim + cols[None, :], item, mask=mask)


def gather_segments(
    rows: torch.Tensor, out_offsets: torch.Tensor, src_starts: torch.Tensor, total_rows: int
) -> torch.Tensor:
    """Copies the runs described by ``out_offsets`` / ``src_starts`` out of ``[N, D]`` ``rows``.

    Args:
        rows: contiguous ``[N, D]`` source.
        out_offsets: ``[S + 1]`` output run offsets (``out_offsets[S] == total_rows``).
        src_starts: ``[S]`` first source row of each output run.
        total_rows: rows of the result, known to the caller without a device sync.

    Returns:
        ``[total_rows, D]`` in ``rows.dtype``.
    """
    dim = rows.shape[1]
    out = torch.empty(total_rows, dim, dtype=rows.dtype, device=rows.device)
    if total_rows == 0 or dim == 0:
        return out
    num_segments = src_starts.numel()
    block_r, block_d = tile_shape(dim, rows.element_size())
    grid = (triton.cdiv(total_rows, block_r), triton.cdiv(dim, block_d))
    _gather_segments_kernel[grid](
        rows,
        out,
        out_offsets,
        src_starts,
        num_segments,
        total_rows,
        dim,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
    )
    return out


class SegmentPermute(torch.autograd.Function):
    """Moves every input run to exactly one output run; the backward moves gradients back.

    ``positions[j]`` is the output run of input run ``j``; the backward reads the gradient of
    input run ``j`` from ``out_offsets[positions[j]]``.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        values: torch.Tensor,
        out_offsets: torch.Tensor,
        src_starts: torch.Tensor,
        in_offsets: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(out_offsets, in_offsets, positions)
        out = gather_segments(as_rows(values), out_offsets, src_starts, values.shape[0])
        return out.reshape(values.shape)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        out_offsets, in_offsets, positions = ctx.saved_tensors
        rows = as_rows(grad)
        back = gather_segments(rows, in_offsets, out_offsets[positions], grad.shape[0])
        return back.reshape(grad.shape), None, None, None, None


def permute_segments(
    values: torch.Tensor,
    out_offsets: torch.Tensor,
    src_starts: torch.Tensor,
    in_offsets: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """``SegmentPermute`` when a gradient is wanted, the bare copy otherwise."""
    if values.requires_grad and torch.is_grad_enabled():
        return SegmentPermute.apply(values, out_offsets, src_starts, in_offsets, positions)
    rows = as_rows(values)
    return gather_segments(rows, out_offsets, src_starts, values.shape[0]).reshape(values.shape)
