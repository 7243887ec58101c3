"""The records one lookup step leaves between its forward and its backward, in both modes."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from freescale_balance import JaggedBatch
from freescale_embed._ops import segment_sum
from freescale_embed.config import Pooling
from freescale_embed.prefetch import Prepared
from freescale_embed.routing import Routes
from freescale_embed.sharding import RowShard
from freescale_embed.telemetry import StepTelemetry, TrainingMark


@dataclass(frozen=True)
class StagedCall:
    """What the next forward gets for its next batch (``stage_next``, or its own arguments).

    Attributes:
        next_batch: the batch of the step after it (``None`` on a final step).
        final: no step follows.
        checked: the caller checked the contents of both batches.
        next_on_host: ``next_batch`` on the host, for routing.
    """

    next_batch: Any
    final: bool
    checked: bool = False
    next_on_host: JaggedBatch | None = None


@dataclass(frozen=True)
class StepUndo:
    """A prioritized strategy's state before a step's forward, to go back to if the step's
    preflight failed (the call may then be made again).

    Attributes:
        prepared: the step that was prepared for this forward (``None``: looked up now).
        announced: the batch announced for this forward at the step before.
        mark: what the training thread had counted in the step's telemetry.
    """

    prepared: Prepared | None
    announced: JaggedBatch | None
    mark: TrainingMark


@dataclass(frozen=True)
class NextStep:
    """A prioritized step's hand-off to the next: its preparation on the prefetch thread (which
    carries this step's preflight) and how to undo this step."""

    future: concurrent.futures.Future
    undo: StepUndo


@dataclass
class Step:
    """One forward awaiting its backward.

    Attributes:
        index: the optimizer step (1-based).
        routes: the step's routing, on the tables' device.
        values: per table, the rows of this rank's unique IDs.
        record: the step's telemetry.
        announced: the batch the step was routed for, announced at the previous step
            (``None``: the forward's own batch).
        next: prioritized mode: the next step's preparation (``None``: sync mode).
        done: its backward ran.
    """

    index: int
    routes: Routes
    values: list[torch.Tensor]
    record: StepTelemetry
    announced: JaggedBatch | None = None
    next: NextStep | None = None
    done: bool = False


def feature_outputs(step: Step, shards: Sequence[RowShard]) -> list[torch.Tensor]:
    """Per feature (in table order), the rows of each of its ID occurrences."""
    outputs = []
    for shard, values, inverse in zip(
        shards, step.values, step.routes.request.inverse, strict=True
    ):
        start = 0
        for name in shard.table.feature_names:
            count = step.routes.request.occurrences[name]
            outputs.append(values.index_select(0, inverse[start : start + count]))
            start += count
    return outputs


def pool(values: torch.Tensor, lengths: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """Per sample, the sum (``"sum"``) or mean (``"mean"``) of its ``lengths`` rows."""
    lengths = lengths.to(torch.int64)
    samples = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=lengths.device),
        lengths,
        output_size=values.shape[0],
    )
    # segment_sum, not index_add: the same bits in both modes on CUDA too.
    pooled = segment_sum(values, samples, lengths.numel())
    if pooling == "mean":
        pooled = pooled / lengths.clamp(min=1).to(values.dtype)[:, None]
    return pooled
