"""Sync mode: each step routes, looks up and syncs its own rows on the training thread.

One step, in TorchRec's words::

    forward:  input_dist (preflight statuses + ID counts, then IDs) -> lookup on the owners
              -> output_dist (rows back)
    backward: per-ID gradients -> gradients to their owners -> per-row sum -> optimizer
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from freescale_balance import JaggedBatch
from freescale_embed.channel import Channel
from freescale_embed.inputs import as_batch
from freescale_embed.optim import Optimizer
from freescale_embed.routing import route
from freescale_embed.sharding import RowShard
from freescale_embed.step import StagedCall, Step
from freescale_embed.tables import TableShard
from freescale_embed.telemetry import StepTelemetry
from freescale_embed.transfers import send_rows, sync_gradients


class SyncLookup:
    """The sync strategy of a ``ShardedEmbeddingCollection``: no state between steps.

    Args:
        tables: this rank's table shards, in table order.
        shards: their row layouts.
        channel: the training thread's channel, on the tables' device (routing there too: it
            is idle at this point, and faster).
    """

    def __init__(
        self, tables: Sequence[TableShard], shards: Sequence[RowShard], channel: Channel
    ) -> None:
        self._tables = list(tables)
        self._shards = list(shards)
        self._channel = channel

    def check_usable(self) -> None:
        """Sync mode has no background update to lose."""

    def is_announced(self, batch: JaggedBatch) -> bool:
        """Sync mode announces no batch ahead."""
        return False

    def call_problem(self, batch: JaggedBatch, staged: StagedCall) -> str | None:
        """Sync mode asks nothing of a call beyond its batch."""
        return None

    def lookup(self, batch: Any, staged: StagedCall, index: int, problem: str | None) -> Step:
        """Routes and looks up ``batch`` now; the preflight rides on the ID counts."""
        features = as_batch(batch).features if problem is None else None
        ids = None if features is None else {n: f.values for n, f in features.items()}
        routes = route(ids, self._shards, self._channel, problem)
        assert routes is not None  # not final
        values = send_rows(self._tables, routes, self._channel)
        return Step(index, routes, values, StepTelemetry(step=index))

    def backward(
        self, step: Step, occurrence_gradients: list[torch.Tensor], optimizer: Optimizer
    ) -> None:
        sync_gradients(
            self._tables, step.routes, occurrence_gradients, self._channel, optimizer, step.index
        )

    def synchronize(self, record: StepTelemetry | None) -> None:
        """Every update ran in its backward."""

    def forget_prefetched(self) -> None:
        """Nothing is prefetched."""

    def close(self) -> None:
        """No thread or group of its own."""
