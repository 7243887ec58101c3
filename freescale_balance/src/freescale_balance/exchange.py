"""Moving whole samples of a jagged batch between ranks with two AllToAlls.

The first AllToAll carries each sent sample's per-feature lengths (its size is known from sample
counts alone); from them every rank knows how many bytes each peer sends, so the second AllToAll
moves every feature's values and every dense field of all samples as one byte buffer, in
destination-major order. Two collectives per exchange, whatever the number of fields.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from freescale_balance.jagged import JaggedBatch, JaggedTensor


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _item_bytes(tensor: torch.Tensor) -> int:
    return tensor.element_size() * math.prod(tensor.shape[1:])


def _segment_sums(per_sample: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Sums of consecutive runs of rows: ``[n, k]`` in runs of ``counts`` -> ``[runs, k]``."""
    prefix = torch.zeros(per_sample.shape[0] + 1, *per_sample.shape[1:], dtype=torch.int64)
    torch.cumsum(per_sample, 0, out=prefix[1:])
    bounds = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=bounds[1:])
    return prefix[bounds[1:]] - prefix[bounds[:-1]]


def exchange_samples(
    batch: JaggedBatch,
    send_counts: torch.Tensor,
    recv_counts: torch.Tensor,
    group: dist.ProcessGroup | None,
) -> JaggedBatch:
    """Sends consecutive runs of ``batch``'s samples to ranks 0, 1, ... and returns what arrives.

    Args:
        batch: local samples, already ordered by destination rank.
        send_counts: int64 ``[world]``, how many of the leading samples go to each rank.
        recv_counts: int64 ``[world]``, samples arriving from each rank (known from the plan).
        group: the process group (its ranks are the destinations).

    Returns:
        The received samples, those of rank 0 first, each rank's in the order they were sent.
        All ranks must pass batches with the same schema.
    """
    features = list(batch.features.items())
    dense = list(batch.dense.items())
    recv_total = int(recv_counts.sum())
    num_features = len(features)

    # AllToAll 1: the lengths of every sent sample, [samples, features] row-major.
    if num_features:
        send_lengths = torch.stack([f.lengths.to(torch.int64) for _, f in features], dim=1)
        recv_lengths = torch.empty(recv_total, num_features, dtype=torch.int64)
        dist.all_to_all_single(
            recv_lengths,
            send_lengths,
            output_split_sizes=recv_counts.tolist(),
            input_split_sizes=send_counts.tolist(),
            group=group,
        )
    else:
        send_lengths = recv_lengths = torch.empty(0, 0, dtype=torch.int64)

    # Bytes per (field, peer), fields in order: features' values, then dense fields.
    feature_item_bytes = torch.tensor(
        [_item_bytes(f.values) for _, f in features], dtype=torch.int64
    )
    dense_row_bytes = torch.tensor([_item_bytes(t) for _, t in dense], dtype=torch.int64)
    send_bytes = torch.cat(
        [
            (_segment_sums(send_lengths, send_counts) * feature_item_bytes).T,
            dense_row_bytes[:, None] * send_counts[None, :],
        ]
    )
    recv_bytes = torch.cat(
        [
            (_segment_sums(recv_lengths, recv_counts) * feature_item_bytes).T,
            dense_row_bytes[:, None] * recv_counts[None, :],
        ]
    )

    # AllToAll 2: one byte buffer, peer-major then field-major.
    fields = [f.values for _, f in features] + [t for _, t in dense]
    pieces = [
        _as_bytes(tensor).split(sizes)
        for tensor, sizes in zip(fields, send_bytes.tolist(), strict=True)
    ]
    world = send_counts.numel()
    send_buffer = torch.cat([pieces[f][peer] for peer in range(world) for f in range(len(fields))])
    recv_buffer = torch.empty(int(recv_bytes.sum()), dtype=torch.uint8)
    dist.all_to_all_single(
        recv_buffer,
        send_buffer,
        output_split_sizes=recv_bytes.sum(0).tolist(),
        input_split_sizes=send_bytes.sum(0).tolist(),
        group=group,
    )

    chunks = recv_buffer.split(recv_bytes.T.reshape(-1).tolist())
    received = [
        torch.cat([chunks[peer * len(fields) + f] for peer in range(world)])
        for f in range(len(fields))
    ]

    def restore(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return raw.view(like.dtype).reshape(-1, *like.shape[1:])

    return JaggedBatch(
        features={
            name: JaggedTensor(
                restore(received[i], f.values), recv_lengths[:, i].to(f.lengths.dtype)
            )
            for i, (name, f) in enumerate(features)
        },
        dense={name: restore(received[num_features + i], t) for i, (name, t) in enumerate(dense)},
    )
