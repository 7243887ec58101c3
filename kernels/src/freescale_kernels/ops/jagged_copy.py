"""The copy every jagged operation ends with: concatenate runs of rows, read from anywhere.

Output row ``o`` belongs to output run ``i`` with ``out_offsets[i] <= o < out_offsets[i + 1]``
and reads row ``src_starts[i] + (o - out_offsets[i])`` of the source. Programs own fixed tiles of
output rows; a program finds the runs of its first and last row with a wide search over all runs
(``find_segment_wide``), then each row's run among those by binary search, so the grid depends
only on the rows moved: no host sync for the longest run, the same work per program whatever the
run lengths (one huge sample included), and nothing proportional to the number of ranks.

Rows are moved as the widest machine words their byte width allows (a bf16 ``[N, 128]`` row is
32 int64 words), which is bit-exact for every dtype and gives each lane fewer, wider accesses.

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
from freescale_kernels.tiles import TUNED, CopyTile

_MAX_BLOCK_D = 256
# The interpreter runs programs one after another in Python, so it gets few, large tiles.
_INTERPRETER_TILE_ELEMENTS = 1 << 16


def tile_shape(dim: int, item_bytes: int, tile: CopyTile) -> tuple[int, int]:
    """(rows, columns) of one program's ``tile`` for rows of ``dim`` items of ``item_bytes``."""
    block_d = min(triton.next_power_of_2(max(dim, 1)), _MAX_BLOCK_D)
    if interpreting():
        return max(_INTERPRETER_TILE_ELEMENTS // block_d, 1), block_d
    block_r = min(max(tile.tile_bytes // (item_bytes * block_d), 1), tile.max_rows)
    return triton.next_power_of_2(block_r), block_d


def as_words(rows: torch.Tensor) -> torch.Tensor:
    """``[N, D]`` rows reinterpreted as the widest integer words (8, 4 or 2 bytes) that tile
    each row and fit its alignment; the same tensor when no wider word fits."""
    size = rows.element_size()
    row_bytes = rows.shape[1] * size
    if rows.dim() != 2 or rows.stride(1) != 1 or rows.shape[1] == 0:
        return rows
    for dtype in (torch.int64, torch.int32, torch.int16):
        word = dtype.itemsize
        if word <= size:
            break
        if row_bytes % word or rows.data_ptr() % word or (rows.stride(0) * size) % word:
            continue
        try:
            return rows.view(dtype)
        except RuntimeError:  # a layout view() refuses: keep the items
            continue
    return rows


def int64_buffers(device: torch.device, *sizes: int) -> list[torch.Tensor]:
    """Int64 tensors of ``sizes`` from one allocation, each starting 16-byte aligned."""
    padded = [size + (size & 1) for size in sizes]
    parts = torch.empty(sum(padded), dtype=torch.int64, device=device).split(padded)
    pieces = zip(parts, sizes, padded, strict=True)
    return [part if size == pad else part[:size] for part, size, pad in pieces]


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
def find_segment_wide(offsets, num_segments, target, LANES: tl.constexpr):
    """``find_segment`` of one scalar target over all runs, ``LANES`` probes at a time.

    Each round loads ``LANES`` evenly spaced offsets at once and keeps the stretch between the
    last one not past the target and the next, so 16K runs take two dependent loads instead of
    a binary search's fourteen; that chain is what every copy program waits on before its rows
    move, at L2 latencies that the copy's own traffic makes long.
    """
    lanes = tl.arange(0, LANES).to(tl.int64)
    lo = tl.full([], 0, tl.int64)
    width = tl.full([], num_segments, tl.int64)  # candidates lo .. lo + width - 1
    while width > 1:
        step = (width + LANES - 1) // LANES
        live = lanes * step < width
        probe = tl.load(offsets + lo + lanes * step, mask=live, other=0).to(tl.int64)
        below = tl.sum((live & (probe <= target)).to(tl.int64), axis=0)  # >= 1: offsets[lo] <= t
        lo += (below - 1) * step
        width = tl.minimum(step, width - (below - 1) * step)
    return lo


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
    src_index,
    num_segments,
    total_rows,
    dim,
    INDIRECT: tl.constexpr,
    LANES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    first = tl.program_id(0).to(tl.int64) * BLOCK_R
    last = tl.minimum(first + BLOCK_R, total_rows) - 1
    rows = first + tl.arange(0, BLOCK_R)
    row_mask = rows < total_rows
    if LANES > 1:
        seg_first = find_segment_wide(out_offsets, num_segments, first, LANES)
        seg_last = find_segment_wide(out_offsets, num_segments, last, LANES)
        width = seg_last + 1 - seg_first
        segment = find_segment(out_offsets, seg_first, seg_last + 1, width, rows, row_mask)
    else:
        segment = find_tile_segments(out_offsets, num_segments, rows, first, last, row_mask)
    run_start = tl.load(out_offsets + segment, mask=row_mask, other=0).to(tl.int64)
    if INDIRECT:
        # The backward of a permutation: run ``segment`` starts where ``src_index[segment]``'s
        # run starts in the source layout; saves materialising ``src_starts[src_index]``.
        segment = tl.load(src_index + segment, mask=row_mask, other=0)
    src_rows = tl.load(src_starts + segment, mask=row_mask, other=0).to(tl.int64)
    src_rows += rows - run_start
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = row_mask[:, None] & (cols < dim)[None, :]
    # No ``other=``: the interpreter cannot build bf16 constants, and masked lanes are not stored.
    item = tl.load(src + src_rows[:, None] * dim + cols[None, :], mask=mask)
    tl.store(dst + rows[:, None] * dim + cols[None, :], item, mask=mask)


def gather_segments(
    rows: torch.Tensor,
    out_offsets: torch.Tensor,
    src_starts: torch.Tensor,
    total_rows: int,
    src_index: torch.Tensor | None = None,
    tile: CopyTile = TUNED.copy,
) -> torch.Tensor:
    """Copies the runs described by ``out_offsets`` / ``src_starts`` out of ``[N, D]`` ``rows``.

    Args:
        rows: contiguous ``[N, D]`` source.
        out_offsets: ``[S + 1]`` output run offsets (``out_offsets[S] == total_rows``).
        src_starts: first source row of each output run, or with ``src_index`` of each source
            run (then output run ``i`` starts at source row ``src_starts[src_index[i]]``).
        total_rows: rows of the result, known to the caller without a device sync.
        src_index: optional ``[S]`` indirection into ``src_starts``.
        tile: the kernel's tile shape.

    Returns:
        ``[total_rows, D]`` in ``rows.dtype``.
    """
    out = torch.empty(total_rows, rows.shape[1], dtype=rows.dtype, device=rows.device)
    if total_rows == 0 or rows.shape[1] == 0:
        return out
    words = as_words(rows)
    out_words = out.view(words.dtype)
    dim = words.shape[1]
    num_segments = out_offsets.numel() - 1
    block_r, block_d = tile_shape(dim, words.element_size(), tile)
    grid = (triton.cdiv(total_rows, block_r), triton.cdiv(dim, block_d))
    _gather_segments_kernel[grid](
        words,
        out_words,
        out_offsets,
        src_starts,
        src_index if src_index is not None else src_starts,
        num_segments,
        total_rows,
        dim,
        INDIRECT=src_index is not None,
        LANES=tile.search_lanes,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=1 if interpreting() else tile.warps,
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
        tile: CopyTile,
    ) -> torch.Tensor:
        ctx.save_for_backward(out_offsets, in_offsets, positions)
        ctx.tile = tile
        out = gather_segments(as_rows(values), out_offsets, src_starts, values.shape[0], tile=tile)
        return out.reshape(values.shape)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        out_offsets, in_offsets, positions = ctx.saved_tensors
        rows = as_rows(grad)
        back = gather_segments(
            rows, in_offsets, out_offsets, grad.shape[0], src_index=positions, tile=ctx.tile
        )
        return back.reshape(grad.shape), None, None, None, None, None


def permute_segments(
    values: torch.Tensor,
    out_offsets: torch.Tensor,
    src_starts: torch.Tensor,
    in_offsets: torch.Tensor,
    positions: torch.Tensor,
    tile: CopyTile = TUNED.copy,
) -> torch.Tensor:
    """``SegmentPermute`` when a gradient is wanted, the bare copy otherwise."""
    if values.requires_grad and torch.is_grad_enabled():
        return SegmentPermute.apply(values, out_offsets, src_starts, in_offsets, positions, tile)
    rows = as_rows(values)
    out = gather_segments(rows, out_offsets, src_starts, values.shape[0], tile=tile)
    return out.reshape(values.shape)
