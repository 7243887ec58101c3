"""The operations: one dispatcher each, over the Triton kernel and the PyTorch reference.

Every function takes ``backend``: ``"triton"``, ``"reference"``, ``"auto"`` or ``None`` (then
``FREESCALE_KERNELS_BACKEND``, else ``"auto"``: Triton for CUDA tensors, the reference elsewhere),
and every one but ``unique_with_inverse`` takes ``tiles``, the Triton kernels' tile shapes
(``freescale_kernels.tiles``; default ``TUNED``).
Both backends return the same values, bit for bit, except where a docstring says otherwise
(float sums). Triton is imported only when the Triton backend runs.

The layouts (key-major, rank-major) are described in ``freescale_kernels.layout``. A worked
round trip, as balance or an embedding input dist uses it (``all_to_all`` stands for the
collectives)::

    sent = ranged_dispatch(values, lengths, ranks, world_size)        # rank-major send buffer
    recv_lengths = all_to_all(sent.lengths, splits=sent.sample_counts * F)
    recv_values = all_to_all(sent.values, splits=sent.rank_splits)
    mine = keyed_transpose(recv_values, recv_lengths, recv_counts, F)  # key-major, by source rank
    ...                                                                # compute on ``mine``
    back = keyed_transpose(out_values, out_lengths, recv_counts, F, to_key_major=False)
    returned, returned_lengths = all_to_all(back.values, ...), all_to_all(back.lengths, ...)
    original = ranged_combine(returned, returned_lengths, ranks, F)   # the original order
"""

from __future__ import annotations

import torch

from freescale_kernels._backend import resolve_backend
from freescale_kernels.layout import Dispatched, JaggedTensor, UniqueResult
from freescale_kernels.ops import reference
from freescale_kernels.tiles import TUNED, Tiles


def jagged_index_select(
    values: torch.Tensor,
    lengths: torch.Tensor,
    indices: torch.Tensor,
    *,
    offsets: torch.Tensor | None = None,
    output_size: int | None = None,
    backend: str | None = None,
    tiles: Tiles = TUNED,
) -> JaggedTensor:
    """The runs of the samples at ``indices``, in that order, in every key.

    Args:
        values: ``[sum(lengths), *item_shape]``, key-major.
        lengths: ``[B]`` or ``[F, B]``, int32 or int64.
        indices: ``[M]`` integer sample indices in ``[0, B)``; any order, repeats allowed.
        offsets: optional ``[F * B + 1]`` exclusive prefix sums of ``lengths.reshape(-1)``
            (int32 or int64), when the caller already has them.
        output_size: optional number of output rows; passing it saves a host sync.
        backend: see the module docstring.
        tiles: see the module docstring.

    Returns:
        ``JaggedTensor(values, lengths)`` with lengths ``[M]`` or ``[F, M]`` in ``lengths.dtype``.
        The gradient of a run picked several times is the sum of its picks' gradients, summed
        in output order (deterministic on both backends; Triton sums bf16 in float32).

    Example::

        >>> values = torch.tensor([1, 2, 3, 4, 5, 6])
        >>> lengths = torch.tensor([[2, 0, 1], [1, 2, 0]])  # 2 keys, 3 samples
        >>> jagged_index_select(values, lengths, torch.tensor([2, 0, 0]))
        JaggedTensor(values=tensor([3, 1, 2, 1, 2, 4, 4]), lengths=tensor([[1, 2, 2],
                [0, 1, 1]]))
    """
    if resolve_backend(backend, values) == "triton":
        from freescale_kernels.ops import index_select

        return index_select.jagged_index_select(
            values, lengths, indices, offsets=offsets, output_size=output_size, tile=tiles.copy
        )
    return reference.jagged_index_select(
        values, lengths, indices, offsets=offsets, output_size=output_size
    )


def ranged_dispatch(
    values: torch.Tensor,
    lengths: torch.Tensor,
    ranks: torch.Tensor,
    world_size: int,
    *,
    backend: str | None = None,
    tiles: Tiles = TUNED,
) -> Dispatched:
    """Packs a keyed jagged tensor into AllToAll send order by each sample's destination rank.

    The send order is rank-major: for each rank, for each key, the runs of the samples going to
    that rank in their original order. Nothing is dropped, so the send buffer has as many rows
    as ``values`` and no host sync is needed; ``.tolist()`` the splits for ``all_to_all_single``.

    Args:
        values: ``[sum(lengths), *item_shape]``, key-major.
        lengths: ``[B]`` or ``[F, B]``, int32 or int64.
        ranks: integer ``[B]``, destination of each sample, in ``[0, world_size)``. Not
            range-checked (that would cost a host sync): a rank outside it corrupts the result.
        world_size: number of ranks.
        backend: see the module docstring.
        tiles: see the module docstring.

    Returns:
        ``Dispatched(values, lengths, rank_splits, key_splits, sample_counts, order)``.
        ``values`` is differentiable; its backward is ``ranged_combine``.

    Example (3 samples, 2 keys, 2 ranks; samples 0 and 2 go to rank 1)::

        >>> values = torch.tensor([10, 11, 12, 20, 21, 22])
        >>> lengths = torch.tensor([[2, 1, 0], [1, 0, 2]])
        >>> sent = ranged_dispatch(values, lengths, torch.tensor([1, 0, 1]), 2)
        >>> sent.values  # rank 0: key 0 [12], key 1 []; rank 1: [10, 11] [] | [20] [21, 22]
        tensor([12, 10, 11, 20, 21, 22])
        >>> sent.lengths
        tensor([1, 0, 2, 0, 1, 2])
        >>> sent.rank_splits, sent.key_splits.tolist(), sent.sample_counts, sent.order
        (tensor([1, 5]), [[1, 0], [2, 3]], tensor([1, 2]), tensor([1, 0, 2]))
    """
    if resolve_backend(backend, values) == "triton":
        from freescale_kernels.ops import ranged

        return ranged.ranged_dispatch(values, lengths, ranks, world_size, tiles.copy)
    return reference.ranged_dispatch(values, lengths, ranks, world_size)


def ranged_combine(
    values: torch.Tensor,
    lengths: torch.Tensor,
    ranks: torch.Tensor,
    num_keys: int,
    *,
    backend: str | None = None,
    tiles: Tiles = TUNED,
) -> JaggedTensor:
    """The inverse of ``ranged_dispatch``: a rank-major buffer back to key-major sample order.

    Sample ``b``'s runs are read from rank ``ranks[b]``'s block of ``values``, where the samples
    of each rank sit in the order they appear in ``ranks``. With the ``ranks`` that dispatched
    them, ``ranged_combine(*ranged_dispatch(v, l, ranks, W)[:2], ranks, F)`` returns ``(v, l)``;
    that is how per-sample results come home after the return AllToAll.

    Args:
        values: ``[sum(lengths), *item_shape]``, rank-major (rank, key, sample).
        lengths: ``[F * B]`` run lengths in the same order.
        ranks: integer ``[B]``, the rank block each output sample is read from (process ranks:
            the Triton backend sorts them as int32).
        num_keys: ``F``.
        backend: see the module docstring.
        tiles: see the module docstring.

    Returns:
        ``JaggedTensor(values, lengths)``: key-major values, lengths ``[F, B]``. Differentiable; the
        backward is ``ranged_dispatch``.

    Example (undoes the ``ranged_dispatch`` example)::

        >>> sent = torch.tensor([12, 10, 11, 20, 21, 22])
        >>> ranged_combine(sent, torch.tensor([1, 0, 2, 0, 1, 2]), torch.tensor([1, 0, 1]), 2)
        JaggedTensor(values=tensor([10, 11, 12, 20, 21, 22]), lengths=tensor([[2, 1, 0],
                [1, 0, 2]]))
    """
    if resolve_backend(backend, values) == "triton":
        from freescale_kernels.ops import ranged

        return ranged.ranged_combine(values, lengths, ranks, num_keys, tiles.copy)
    return reference.ranged_combine(values, lengths, ranks, num_keys)


def keyed_transpose(
    values: torch.Tensor,
    lengths: torch.Tensor,
    counts: torch.Tensor,
    num_keys: int,
    *,
    to_key_major: bool = True,
    backend: str | None = None,
    tiles: Tiles = TUNED,
) -> JaggedTensor:
    """Rank-major (rank, key, sample) <-> key-major (key, rank, sample) jagged layouts.

    The ``N = counts.sum()`` samples form consecutive blocks, ``counts[r]`` for rank ``r``.
    Rank-major to key-major is what a receiver does after the AllToAll (samples end up ordered
    by source rank); key-major to rank-major packs results to send back.

    Args:
        values: ``[sum(lengths), *item_shape]`` in the input layout.
        lengths: ``F * N`` run lengths in the input layout (any shape).
        counts: integer ``[W]`` samples per rank block.
        num_keys: ``F``.
        to_key_major: the direction; ``False`` transposes key-major to rank-major.
        backend: see the module docstring.
        tiles: see the module docstring.

    Returns:
        ``JaggedTensor(values, lengths)``: lengths ``[F, N]`` when key-major, flat ``[F * N]`` when
        rank-major. Differentiable; the backward is the opposite transpose.

    Example (2 ranks sent 1 and 2 samples of 2 keys)::

        >>> received = torch.tensor([12, 10, 11, 20, 21, 22])
        >>> keyed_transpose(received, torch.tensor([1, 0, 2, 0, 1, 2]), torch.tensor([1, 2]), 2)
        JaggedTensor(values=tensor([12, 10, 11, 20, 21, 22]), lengths=tensor([[1, 2, 0],
                [0, 1, 2]]))
    """
    if resolve_backend(backend, values) == "triton":
        from freescale_kernels.ops import ranged

        return ranged.keyed_transpose(
            values, lengths, counts, num_keys, to_key_major=to_key_major, tile=tiles.copy
        )
    return reference.keyed_transpose(values, lengths, counts, num_keys, to_key_major=to_key_major)


def unique_with_inverse(ids: torch.Tensor, *, backend: str | None = None) -> UniqueResult:
    """Sorted unique IDs with the inverse map, counts, run offsets and sorting order.

    Deterministic on both backends (a stable sort of integers); one host sync for the number of
    unique IDs.

    Args:
        ids: integer ``[N]``.
        backend: see the module docstring.

    Returns:
        ``UniqueResult(values, inverse, counts, offsets, order)``; see its docstring.

    Example::

        >>> result = unique_with_inverse(torch.tensor([7, 3, 7, 5, 3, 7]))
        >>> result.values, result.inverse, result.counts
        (tensor([3, 5, 7]), tensor([2, 0, 2, 1, 0, 2]), tensor([2, 1, 3]))
        >>> result.offsets, result.order
        (tensor([0, 2, 3, 6]), tensor([1, 4, 3, 0, 2, 5]))
    """
    if resolve_backend(backend, ids) == "triton":
        from freescale_kernels.ops import dedup

        return dedup.unique_with_inverse(ids)
    return reference.unique_with_inverse(ids)


def segment_sum(
    values: torch.Tensor,
    offsets: torch.Tensor | None = None,
    *,
    segment_ids: torch.Tensor | None = None,
    num_segments: int | None = None,
    order: torch.Tensor | None = None,
    backend: str | None = None,
    tiles: Tiles = TUNED,
) -> torch.Tensor:
    """Sums of consecutive runs of rows, in a fixed order: bitwise reproducible run to run.

    Segment ``s`` sums rows ``offsets[s]:offsets[s + 1]`` of ``values`` or, with ``order``, of
    ``values[order]`` without materialising it; with ``UniqueResult`` that aggregates the
    gradients of repeated IDs: ``segment_sum(grads, result.offsets, order=result.order)``.
    Floats accumulate in float32 (float64 for float64) and integers in int64, then round to
    ``values.dtype``. The backends sum in different (each fixed) orders, so float results
    agree to rounding, not bitwise.

    Args:
        values: ``[N, *item_shape]``.
        offsets: ``[S + 1]`` non-decreasing, from 0 to the number of summed rows.
        segment_ids: instead of ``offsets``, a sorted ``[N]`` segment id per summed row.
        num_segments: ``S``, required with ``segment_ids``.
        order: optional integer ``[R]``, distinct rows of ``values`` to sum, in this order.
        backend: see the module docstring.
        tiles: see the module docstring.

    Returns:
        ``[S, *item_shape]`` in ``values.dtype``; empty segments sum to 0. Differentiable.

    Example::

        >>> values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
        >>> segment_sum(values, torch.tensor([0, 2, 2, 3]))
        tensor([[4., 6.],
                [0., 0.],
                [5., 6.]])
        >>> segment_sum(values, segment_ids=torch.tensor([0, 0, 1]), num_segments=2,
        ...             order=torch.tensor([2, 0, 1]))
        tensor([[6., 8.],
                [3., 4.]])
    """
    if resolve_backend(backend, values) == "triton":
        from freescale_kernels.ops import dedup

        return dedup.segment_sum(
            values,
            offsets,
            segment_ids=segment_ids,
            num_segments=num_segments,
            order=order,
            tile=tiles.segment_sum,
        )
    return reference.segment_sum(
        values, offsets, segment_ids=segment_ids, num_segments=num_segments, order=order
    )
