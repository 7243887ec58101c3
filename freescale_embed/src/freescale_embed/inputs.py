"""Input checks, and the preflight that makes every rank raise the same error.

A rank that finds a problem in its own input cannot just raise: its peers would block in the next
collective. So every ID exchange carries a status from each rank in front of the ID counts ("my
input is bad", or in prioritized mode "I have no next step"); if any rank raised the flag, every
rank gathers the messages and raises the same ``EmbeddingInputError`` before any ID of the
invalid input moves.

A synchronous lookup routes its batch on the critical path, so its own ID exchange carries the
flag and every rank raises in forward. A prioritized step has nothing to route on the critical
path (its IDs were routed during the previous step): its flag rides on the prefetch thread's
routing of the next step, every rank's forward returns (the rank with the problem returns the
rows prefetched for the batch it announced), and every rank raises in the step's backward, after
which the step is undone, so the same call can be made again. Raising at the same point on every
rank keeps collectives the caller runs between forward and backward paired.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from freescale_balance import JaggedBatch, JaggedBatchError
from freescale_embed.channel import Channel
from freescale_embed.sharding import RowShard


class EmbeddingInputError(ValueError):
    """Raised identically on every rank when some rank's input cannot be looked up."""


def as_batch(batch: Any) -> JaggedBatch:
    """The jagged batch of ``batch``: a ``JaggedBatch`` or a TorchRec ``KeyedJaggedTensor``."""
    if isinstance(batch, JaggedBatch):
        return batch
    if hasattr(batch, "to_dict") and hasattr(batch, "keys"):
        return JaggedBatch.from_keyed_jagged_tensor(batch)
    raise TypeError(
        f"expected a freescale_balance.JaggedBatch or a TorchRec KeyedJaggedTensor, "
        f"got {type(batch).__name__}"
    )


def batch_problem(
    batch: JaggedBatch,
    shards: Sequence[RowShard],
    device: torch.device,
    *,
    checked: bool = False,
) -> str | None:
    """What is wrong with ``batch`` for these tables on ``device``, or ``None``.

    Checks that every feature a table reads is present, on ``device``, well formed (integer,
    non-negative lengths that cover the values), holds 1-D integer IDs, and that every ID is a
    row of its table. A batch whose contents the caller ``checked`` is checked for the first two
    only (nothing read from the device).
    """
    for shard in shards:
        table = shard.table
        for name in table.feature_names:
            feature = batch.features.get(name)
            if feature is None:
                return f"feature {name!r} (table {table.name!r}) is not in the batch"
            ids = feature.values
            if ids.device != device or feature.lengths.device != device:
                return (
                    f"feature {name!r}: IDs and lengths must be on the tables' device {device}, "
                    f"got {ids.device} and {feature.lengths.device}"
                )
            if checked:
                continue
            try:
                feature.validate(f"feature {name!r}")
            except JaggedBatchError as error:
                return str(error)
            if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex:
                return (
                    f"feature {name!r}: IDs must be a 1-D integer tensor, got "
                    f"{ids.dtype} of shape {tuple(ids.shape)}"
                )
            if ids.dtype == torch.bool:
                return f"feature {name!r}: IDs must be integers, got bool"
            if not ids.numel():
                continue
            bad = (ids < 0) | (ids >= table.num_embeddings)
            if bool(bad.any()):
                position = int(torch.nonzero(bad)[0])
                return (
                    f"feature {name!r}: ID {int(ids[position])} at position {position} is out of "
                    f"range for table {table.name!r} (rows 0..{table.num_embeddings - 1})"
                )
    return None


def same_ids(a: JaggedBatch, b: JaggedBatch, shards: Sequence[RowShard]) -> str | None:
    """``None`` if both batches hold the same IDs for every table feature, else the first one."""
    if a is b:
        return None
    for shard in shards:
        for name in shard.table.feature_names:
            x, y = a.features[name], b.features[name]
            if not (
                torch.equal(x.lengths.to(torch.int64), y.lengths.to(torch.int64))
                and torch.equal(x.values.to(torch.int64), y.values.to(torch.int64))
            ):
                return name
    return None


def raise_if_flagged(channel: Channel, problem: str | None, flags: Sequence[bool]) -> None:
    """Raises the same ``EmbeddingInputError`` on every rank if any rank flagged a problem.

    Args:
        channel: the channel whose collective carried the flags (it gathers the messages, on
            the error path only).
        problem: this rank's problem, or ``None``.
        flags: per rank, whether that rank has a problem, as every rank received them in front
            of the ID counts.
    """
    if not any(flags):
        return
    problems = channel.all_gather_object(problem)
    lines = [f"rank {rank}: {text}" for rank, text in enumerate(problems) if text]
    raise EmbeddingInputError("cannot look up this batch:\n  " + "\n  ".join(lines))
