"""The jagged layouts the operations read and write, their result types, and shared helpers.

Movements return a ``JaggedTensor`` (``freescale_kernels._jagged``, the container
``freescale_balance`` shares), which unpacks as ``values, lengths``.

Vocabulary (TorchRec's): a *keyed jagged tensor* holds ``F`` keys (features, tables) over the same
``B`` samples. ``lengths`` is ``[F, B]``: the run length of sample ``b`` in key ``f``. ``values``
holds every run, **key-major**: key 0's runs of samples ``0..B-1``, then key 1's, ... (the flat
``lengths.reshape(-1)`` order), so ``values.shape[0] == lengths.sum()``. Values may carry an item
shape (``[N, D]`` embedding rows); an operation moves whole rows. A 1-D ``lengths`` ``[B]`` is a
single key.

Between ranks the same data travels **rank-major**: for destination (or source) rank ``r``, for
key ``f``, the runs of that rank's samples in their original order. Its lengths are a flat
``[F * B]`` tensor in that same (rank, key, sample) order; a rank's part is ``F * n_r`` lengths
and its values are one contiguous block, which is what an AllToAll's split sizes describe.

Ranks only ever enter as per-sample integers or per-rank counts, so no operation loops over ranks.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from freescale_kernels._jagged import JaggedTensor as JaggedTensor


class Dispatched(NamedTuple):
    """A keyed jagged tensor packed in AllToAll send order, with everything the AllToAlls need.

    Attributes:
        values: the send buffer, rank-major (rank, key, sample); ``values.shape[0]`` is unchanged.
        lengths: ``[F * B]`` run lengths in the same order, ``lengths.dtype`` as given.
        rank_splits: int64 ``[world_size]``, value rows sent to each rank (``input_split_sizes``
            of the values AllToAll).
        key_splits: int64 ``[world_size, F]``, value rows per (rank, key).
        sample_counts: int64 ``[world_size]``, samples sent to each rank; the lengths AllToAll's
            split sizes are ``sample_counts * F``.
        order: int64 ``[B]``, the samples in send order (grouped by rank, original order within a
            rank); ``dense[order]`` packs per-sample dense fields the same way.
    """

    values: torch.Tensor
    lengths: torch.Tensor
    rank_splits: torch.Tensor
    key_splits: torch.Tensor
    sample_counts: torch.Tensor
    order: torch.Tensor


class UniqueResult(NamedTuple):
    """Sorted unique IDs and the maps between them and the input.

    Attributes:
        values: ``[U]`` the distinct IDs, ascending, in the input dtype.
        inverse: int64 ``[N]``, ``values[inverse] == ids``.
        counts: int64 ``[U]``, occurrences of each unique ID.
        offsets: int64 ``[U + 1]``, exclusive prefix sum of ``counts``.
        order: int64 ``[N]``, the stable sorting permutation of ``ids``: the occurrences of
            ``values[u]`` are ``order[offsets[u]:offsets[u + 1]]``, in increasing position.
    """

    values: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    order: torch.Tensor


def keyed_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """``lengths`` as a contiguous ``[F, B]`` tensor (a 1-D ``[B]`` is one key)."""
    if lengths.dim() == 1:
        return lengths.reshape(1, -1)
    if lengths.dim() != 2:
        raise ValueError(f"lengths must be [B] or [F, B], got shape {tuple(lengths.shape)}")
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise ValueError(f"lengths must be integers, got {lengths.dtype}")
    return lengths.contiguous()


def exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """int64 ``[n + 1]``: 0 followed by the running sums of the 1-D ``x``."""
    out = torch.zeros(x.numel() + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(x.reshape(-1), 0, dtype=torch.int64, out=out[1:])
    return out


def as_rows(values: torch.Tensor) -> torch.Tensor:
    """A contiguous ``[N, D]`` view of ``values`` (``D = 1`` for 1-D values)."""
    if values.dim() == 0:
        raise ValueError("values must have at least one dimension")
    return values.contiguous().reshape(values.shape[0], math.prod(values.shape[1:]))


def offsets_from_segment_ids(segment_ids: torch.Tensor, num_segments: int) -> torch.Tensor:
    """int64 ``[num_segments + 1]``: where each id's run starts in sorted ``segment_ids``."""
    targets = torch.arange(num_segments + 1, device=segment_ids.device, dtype=segment_ids.dtype)
    return torch.searchsorted(segment_ids.contiguous(), targets).to(torch.int64)


def check_world_size(world_size: int) -> None:
    """Raises ``ValueError`` unless ``world_size >= 1``."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")


def check_ranks(ranks: torch.Tensor) -> None:
    """Raises ``ValueError`` unless ``ranks`` is a 1-D integer tensor (values are not checked)."""
    if ranks.dim() != 1 or ranks.dtype.is_floating_point or ranks.dtype == torch.bool:
        raise ValueError(f"ranks must be 1-D integers, got {ranks.dtype} {tuple(ranks.shape)}")


def num_samples(lengths: torch.Tensor, num_keys: int) -> int:
    """Samples in flat rank-major ``lengths`` that hold ``num_keys`` lengths per sample."""
    if num_keys < 0:
        raise ValueError(f"num_keys must be non-negative, got {num_keys}")
    if num_keys == 0:
        if lengths.numel():
            raise ValueError("num_keys is 0 but lengths are not empty")
        return 0
    if lengths.numel() % num_keys:
        raise ValueError(f"{lengths.numel()} lengths do not split into {num_keys} keys")
    return lengths.numel() // num_keys
