"""Moving whole samples of a jagged batch between ranks with two AllToAlls.

The first AllToAll carries each sent sample's per-feature lengths (its size is known from sample
counts alone); from them every rank knows how many bytes each peer sends, so the second AllToAll
moves every feature's values and every dense field of all samples as one byte buffer. On the wire
the buffer is rank-major: for each peer, for each field (features, then dense fields), the bytes
of that peer's samples in order — the layout of ``freescale_kernels.ranged_dispatch``.

Packing and unpacking use ``freescale_kernels`` when it is installed (Triton on CUDA tensors, its
vectorized reference elsewhere; no Python loop over ranks) and a built-in eager path otherwise,
so ``freescale-balance`` installs alone. Both produce the same bytes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from freescale_balance.jagged import JaggedBatch, JaggedTensor

try:
    import freescale_kernels
except ImportError:
    freescale_kernels = None

KERNELS_ENV = "FREESCALE_BALANCE_KERNELS"


def kernels_enabled() -> bool:
    """Whether packing uses ``freescale_kernels``: installed, not disabled by ``KERNELS_ENV=0``."""
    return freescale_kernels is not None and os.environ.get(KERNELS_ENV, "1") != "0"


def _segment_sums(per_sample: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Sums of consecutive runs of rows: ``[n, k]`` in runs of ``counts`` -> ``[runs, k]``."""
    prefix = torch.zeros(per_sample.shape[0] + 1, *per_sample.shape[1:], dtype=torch.int64)
    torch.cumsum(per_sample, 0, out=prefix[1:])
    bounds = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=bounds[1:])
    return prefix[bounds[1:]] - prefix[bounds[:-1]]


@dataclass(frozen=True)
class _ByteFields:
    """A batch as bytes: key-major ``values``, ``lengths [fields, samples]`` counted in bytes."""

    values: torch.Tensor
    lengths: torch.Tensor


def _field_tensors(batch: JaggedBatch) -> list[torch.Tensor]:
    return [f.values for f in batch.features.values()] + list(batch.dense.values())


def _row_bytes(tensor: torch.Tensor) -> int:
    return tensor.element_size() * math.prod(tensor.shape[1:])


def _byte_lengths(batch: JaggedBatch, feature_lengths: torch.Tensor) -> torch.Tensor:
    """int64 ``[fields, samples]``: bytes each sample holds in each field."""
    rows = torch.tensor([_row_bytes(t) for t in _field_tensors(batch)], dtype=torch.int64)
    num_features = len(batch.features)
    samples = feature_lengths.shape[0]
    counts = torch.cat(
        [feature_lengths.T, torch.ones(rows.numel() - num_features, samples, dtype=torch.int64)]
    )
    return counts * rows[:, None]


def _as_byte_fields(batch: JaggedBatch, feature_lengths: torch.Tensor) -> _ByteFields:
    raw = [t.contiguous().reshape(-1).view(torch.uint8) for t in _field_tensors(batch)]
    return _ByteFields(torch.cat(raw), _byte_lengths(batch, feature_lengths))


def _from_key_major_bytes(
    values: torch.Tensor, lengths: torch.Tensor, like: JaggedBatch, feature_lengths: torch.Tensor
) -> JaggedBatch:
    """Splits key-major bytes back into the fields of ``like``'s schema."""
    pieces = values.split(lengths.sum(1).tolist())
    fields = _field_tensors(like)

    def restore(raw: torch.Tensor, field: torch.Tensor) -> torch.Tensor:
        if raw.storage_offset() % field.element_size():
            raw = raw.clone()  # a field that starts mid-word in the buffer cannot be viewed
        return raw.view(field.dtype).reshape(-1, *field.shape[1:])

    names = list(like.features)
    return JaggedBatch(
        features={
            name: JaggedTensor(
                restore(pieces[i], fields[i]),
                feature_lengths[:, i].to(like.features[name].lengths.dtype),
            )
            for i, name in enumerate(names)
        },
        dense={
            name: restore(pieces[len(names) + i], fields[len(names) + i])
            for i, name in enumerate(like.dense)
        },
    )


def _rank_major_lengths(lengths: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[fields, samples]`` byte lengths, samples in rank blocks -> flat (rank, field, sample)."""
    num_fields, samples = lengths.shape
    bounds = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=bounds[1:])
    block = torch.repeat_interleave(torch.arange(counts.numel()), counts, output_size=samples)
    start = bounds[block]
    position = (
        num_fields * start
        + torch.arange(num_fields)[:, None] * counts[block]
        + (torch.arange(samples) - start)
    )
    flat = torch.empty(num_fields * samples, dtype=lengths.dtype)
    flat[position.reshape(-1)] = lengths.reshape(-1)
    return flat


def _pack_eager(
    fields: _ByteFields, order: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank-major send buffer and its bytes per peer: the loop-over-ranks fallback."""
    num_fields = fields.lengths.shape[0]
    offsets = torch.zeros(num_fields + 1, dtype=torch.int64)
    torch.cumsum(fields.lengths.sum(1), 0, out=offsets[1:])
    per_field = [
        JaggedTensor(fields.values[offsets[f] : offsets[f + 1]], fields.lengths[f]).select(order)
        for f in range(num_fields)
    ]
    sizes = _segment_sums(fields.lengths[:, order].T, counts)  # [peers, fields]
    rows = sizes.tolist()
    pieces = [p.values.split([row[f] for row in rows]) for f, p in enumerate(per_field)]
    buffer = torch.cat(
        [pieces[f][peer] for peer in range(counts.numel()) for f in range(num_fields)]
    )
    return buffer, sizes.sum(1)


def _unpack_eager(buffer: torch.Tensor, lengths: torch.Tensor, counts: torch.Tensor):
    """Rank-major received bytes -> key-major ``(values, lengths)``, samples by source rank."""
    num_fields = lengths.shape[0]
    sizes = _segment_sums(lengths.T, counts)  # [peers, fields]
    chunks = buffer.split(sizes.reshape(-1).tolist())
    values = torch.cat(
        [chunks[peer * num_fields + f] for f in range(num_fields) for peer in range(counts.numel())]
    )
    return values, lengths


def exchange_samples(
    batch: JaggedBatch,
    destinations: torch.Tensor,
    recv_counts: torch.Tensor,
    group: dist.ProcessGroup | None,
    combine_ranks: torch.Tensor | None = None,
) -> JaggedBatch:
    """Sends each local sample to its destination rank and returns what arrives.

    Args:
        batch: local samples (every rank's batch has the same schema).
        destinations: int64 ``[batch_size]``, the rank each sample goes to.
        recv_counts: int64 ``[world]``, how many samples arrive from each rank (known from the
            plan, so no count exchange is needed).
        group: the process group whose ranks the destinations name.
        combine_ranks: ``None`` to return the arrivals grouped by source rank (each rank's in the
            order it sent them), or int64 ``[recv_counts.sum()]``: output sample ``i`` is the
            next arrival from rank ``combine_ranks[i]`` (how ``unshuffle`` restores the order
            the samples were loaded in).

    Returns:
        The received samples.
    """
    world = recv_counts.numel()
    use_kernels = kernels_enabled()
    num_features = len(batch.features)
    feature_lengths = torch.stack(
        [f.lengths.to(torch.int64) for f in batch.features.values()]
        or [torch.zeros(batch.batch_size, dtype=torch.int64)],
        dim=1,
    )[:, :num_features]
    fields = _as_byte_fields(batch, feature_lengths)

    if use_kernels:
        sent = freescale_kernels.ranged_dispatch(fields.values, fields.lengths, destinations, world)
        send_buffer, order, send_counts = sent.values, sent.order, sent.sample_counts
        send_bytes = sent.rank_splits
    else:
        order = torch.argsort(destinations, stable=True)
        send_counts = torch.bincount(destinations, minlength=world)
        send_buffer, send_bytes = _pack_eager(fields, order, send_counts)

    # AllToAll 1: the per-feature lengths of every sent sample, [samples, features].
    recv_total = int(recv_counts.sum())
    recv_lengths = torch.empty(recv_total, num_features, dtype=torch.int64)
    if num_features:
        dist.all_to_all_single(
            recv_lengths,
            feature_lengths[order].contiguous(),
            output_split_sizes=recv_counts.tolist(),
            input_split_sizes=send_counts.tolist(),
            group=group,
        )
    recv_bytes = _byte_lengths(batch, recv_lengths)

    # AllToAll 2: every field's bytes, rank-major.
    recv_buffer = torch.empty(int(recv_bytes.sum()), dtype=torch.uint8)
    dist.all_to_all_single(
        recv_buffer,
        send_buffer,
        output_split_sizes=_segment_sums(recv_bytes.T, recv_counts).sum(1).tolist(),
        input_split_sizes=send_bytes.tolist(),
        group=group,
    )

    if combine_ranks is None:
        if use_kernels:
            values, lengths = freescale_kernels.keyed_transpose(
                recv_buffer,
                _rank_major_lengths(recv_bytes, recv_counts),
                recv_counts,
                recv_bytes.shape[0],
            )
        else:
            values, lengths = _unpack_eager(recv_buffer, recv_bytes, recv_counts)
        return _from_key_major_bytes(values, lengths, batch, recv_lengths)

    restore = torch.argsort(torch.argsort(combine_ranks, stable=True))
    if use_kernels:
        values, lengths = freescale_kernels.ranged_combine(
            recv_buffer,
            _rank_major_lengths(recv_bytes, recv_counts),
            combine_ranks,
            recv_bytes.shape[0],
        )
        return _from_key_major_bytes(values, lengths, batch, recv_lengths[restore])
    values, lengths = _unpack_eager(recv_buffer, recv_bytes, recv_counts)
    return _from_key_major_bytes(values, lengths, batch, recv_lengths).select(restore)
