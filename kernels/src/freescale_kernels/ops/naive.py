"""NAIVE per-rank loops, for the benchmark only: not used by any dispatcher.

This is how jagged AllToAll packing is commonly first written (and how ``freescale_balance``'s
shuffle packs today): select each rank's samples, then split and concatenate per (rank, key).
Its cost grows with the world size (``O(W * F)`` small ops and host syncs), which is what the
vectorized reference and the Triton kernels remove. Same signatures and results as
``reference``.
"""

from __future__ import annotations

import torch

from freescale_kernels.layout import Dispatched, JaggedTensor, exclusive_cumsum, keyed_lengths
from freescale_kernels.ops.reference import gather_segments


def _select(values: torch.Tensor, lengths: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
    offsets = exclusive_cumsum(lengths)
    picked = lengths[samples]
    return gather_segments(values, offsets[samples], picked, int(picked.sum()))


def ranged_dispatch(
    values: torch.Tensor, lengths: torch.Tensor, ranks: torch.Tensor, world_size: int
) -> Dispatched:
    """NAIVE (per-rank loop) ``ranged_dispatch``."""
    keyed = keyed_lengths(lengths)
    num_keys = keyed.shape[0]
    per_key = values.split(keyed.sum(1).tolist())
    pieces, piece_lengths, orders = [], [], []
    key_splits = torch.zeros(world_size, num_keys, dtype=torch.int64)
    for rank in range(world_size):
        samples = torch.nonzero(ranks == rank).reshape(-1)
        orders.append(samples)
        for key in range(num_keys):
            piece = _select(per_key[key], keyed[key], samples)
            pieces.append(piece)
            piece_lengths.append(keyed[key][samples])
            key_splits[rank, key] = piece.shape[0]
    device = values.device
    key_splits = key_splits.to(device)
    counts = torch.tensor([o.numel() for o in orders], dtype=torch.int64, device=device)
    return Dispatched(
        torch.cat(pieces) if pieces else values[:0],
        torch.cat(piece_lengths) if piece_lengths else keyed.reshape(-1)[:0],
        key_splits.sum(1),
        key_splits,
        counts,
        torch.cat(orders),
    )


def ranged_combine(
    values: torch.Tensor, lengths: torch.Tensor, ranks: torch.Tensor, num_keys: int
) -> JaggedTensor:
    """NAIVE (per-rank loop) ``ranged_combine``."""
    world_size = int(ranks.max()) + 1 if ranks.numel() else 1
    flat = lengths.reshape(-1)
    offsets = exclusive_cumsum(flat)
    per_key_values: list[list[torch.Tensor]] = [[] for _ in range(num_keys)]
    per_key_lengths: list[list[torch.Tensor]] = [[] for _ in range(num_keys)]
    orders, run = [], 0
    for rank in range(world_size):
        samples = torch.nonzero(ranks == rank).reshape(-1)
        orders.append(samples)
        for key in range(num_keys):
            block = flat[run : run + samples.numel()]
            start, end = int(offsets[run]), int(offsets[run + samples.numel()])
            per_key_values[key].append(values[start:end])
            per_key_lengths[key].append(block)
            run += samples.numel()
    # Received order is (rank, sample); put each key's runs back in the original sample order.
    inverse = torch.argsort(torch.cat(orders))
    out_values, out_lengths = [], []
    for key in range(num_keys):
        key_lengths = torch.cat(per_key_lengths[key])
        out_values.append(_select(torch.cat(per_key_values[key]), key_lengths, inverse))
        out_lengths.append(key_lengths[inverse])
    return JaggedTensor(
        torch.cat(out_values) if out_values else values[:0],
        torch.stack(out_lengths) if out_lengths else flat.reshape(0, ranks.numel()),
    )


def keyed_transpose(
    values: torch.Tensor,
    lengths: torch.Tensor,
    counts: torch.Tensor,
    num_keys: int,
    *,
    to_key_major: bool = True,
) -> JaggedTensor:
    """NAIVE (per-rank loop) ``keyed_transpose``."""
    flat = lengths.reshape(-1)
    counts_list = counts.tolist()
    total = sum(counts_list)
    world_size = len(counts_list)
    # Runs per (rank, key) block in the input layout, then the blocks' row counts.
    if to_key_major:
        block_runs = [c for c in counts_list for _ in range(num_keys)]
    else:
        block_runs = [c for _ in range(num_keys) for c in counts_list]
    length_blocks = flat.split(block_runs)
    value_blocks = values.split([int(b.sum()) for b in length_blocks])
    if to_key_major:
        pick = [r * num_keys + k for k in range(num_keys) for r in range(world_size)]
    else:
        pick = [k * world_size + r for r in range(world_size) for k in range(num_keys)]
    out_values = torch.cat([value_blocks[i] for i in pick]) if pick else values[:0]
    out_lengths = torch.cat([length_blocks[i] for i in pick]) if pick else flat[:0]
    if to_key_major:
        out_lengths = out_lengths.reshape(num_keys, total)
    return JaggedTensor(out_values, out_lengths)
