"""Prioritized mode's background half: prefetching step t+1 and finishing step t's gradient sync.

With ``R_t`` the rows of step t over all ranks and ``C_t = R_t ∩ R_t+1`` its collision rows:

- ``prepare_next`` (during step t, on the prefetch thread): routes step t+1's IDs (that exchange
  carries step t's preflight), finds ``C_t`` on each owner, plans the collision update
  (``collision_plan``: who sends which gradient to whom) and sends every row of t+1, with the
  optimizer state of the rows of ``C_t``. Step t does not change those rows before its
  backward, and every earlier update of them has already run.
- the training thread's backward of step t then sends the gradients of ``C_t`` in one AllToAll,
  and step t+1's forward applies them on the owners and, identically, to the prefetched copies
  of t+1, so it has every row at hand, and
- during step t+1, on the prefetch thread, the rest of step t's gradients (rows that step t+1
  does not read) are synced and applied before step t+2's prefetch reads any row: their
  AllToAll is started first in step t+2's ``prepare_next`` and travels while step t+2 is routed
  and planned (IDs only), then applied before its rows are sent (``finish_gradients`` does the
  same alone, for ``synchronize``).

That task is submitted at the start of step t+1, so it never competes with step t's
critical-path collective.

One thread runs these tasks in submission order on its own process group (and, for CPU tensors
where that group's backend moves none, a Gloo group of its own), so they never interleave with
the training thread's collectives. The two threads never touch the tables at
the same time: the training thread reads or writes rows only when the prefetch thread has
nothing left to do (it waits for the prefetch of the next step before applying collision
updates; a fallback step reads its rows at the start of its forward, before the next task,
which carries the deferred sync, is submitted).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from freescale_balance import JaggedTensor
from freescale_embed.channel import Channel
from freescale_embed.collision_plan import CollisionPlan, find_collision_rows, plan_collisions
from freescale_embed.optim import Optimizer
from freescale_embed.routing import Routes, host_ids, route
from freescale_embed.sharding import RowShard
from freescale_embed.streams import to_device
from freescale_embed.tables import TableShard
from freescale_embed.telemetry import StepTelemetry
from freescale_embed.transfers import (
    Part,
    PendingExchange,
    apply_gradients,
    send_rows,
    send_rows_with_state,
    start_gradients,
    unique_gradients,
)


@dataclass
class Prepared:
    """Step t+1 as prepared during step t.

    Attributes:
        routes: step t+1's routing, on the tables' device.
        host_routes: the same on the host (step t+2's prefetch plans with it).
        values: per table, the rows of t+1's unique IDs on this rank; the rows of ``C_t`` hold
            their values before step t's update until step t+1's forward applies it to them
            (empty in a fallback, whose forward fetches every row).
        collisions: ``|C_t|`` over all ranks.
        unique_rows: ``|R_t+1|`` over all ranks.
        fallback: the guardrail tripped: every row of t is synced in t's backward and every row
            of t+1 is fetched in t+1's forward.
        plan: the update of the collision rows sent in step t's backward (``None`` without any, or
            in a fallback).
        record: step t+1's telemetry.
    """

    routes: Routes
    host_routes: Routes
    values: list[torch.Tensor]
    collisions: int
    unique_rows: int
    fallback: bool
    plan: CollisionPlan | None
    record: StepTelemetry

    @property
    def rest(self) -> Part | None:
        """The part of step t synced in the background (``None``: all of it)."""
        return None if self.plan is None else self.plan.others

    def nbytes(self) -> int:
        """Bytes held between the steps: prefetched rows, routing (on the device and the
        host) and plans."""
        planned = 0 if self.plan is None else self.plan.nbytes()
        rows = sum(t.numel() * t.element_size() for t in self.values)
        routing = self.routes.nbytes()
        if self.host_routes is not self.routes:
            routing += self.host_routes.nbytes()
        return routing + planned + rows


@dataclass(frozen=True)
class DeferredGradients:
    """Step t's gradients of the rows outside ``C_t``, synced during step t+1.

    ``optimizer`` and ``step`` are those of step t, captured when its backward ran, so a learning
    rate changed since then does not leak into this update.

    Attributes:
        routes: step t's routing.
        occurrence_gradients: per table, step t's gradient of each ID occurrence.
        part: the rows outside ``C_t`` (``None``: every row of step t).
        optimizer: step t's optimizer.
        step: step t's index.
        record: step t's telemetry (the sync counts as its background communication).
    """

    routes: Routes
    occurrence_gradients: Sequence[torch.Tensor]
    part: Part | None
    optimizer: Optimizer
    step: int
    record: StepTelemetry


class UpdateLost(RuntimeError):
    """Syncing or applying a step's deferred gradients failed: the tables miss that update."""


@contextlib.contextmanager
def _updating(deferred: DeferredGradients) -> Iterator[None]:
    try:
        yield
    except Exception as error:
        raise UpdateLost(
            f"syncing the gradients of step {deferred.step} outside its collision rows failed "
            f"({type(error).__name__}: {error})"
        ) from error


@dataclass(frozen=True)
class _StartedGradients:
    """``DeferredGradients`` whose AllToAll is under way."""

    deferred: DeferredGradients
    exchange: PendingExchange

    def finish(self, tables: Sequence[TableShard], channel: Channel) -> None:
        """Waits for the gradients and applies them on their owners.

        Raises:
            UpdateLost: if that fails.
        """
        deferred = self.deferred
        with _updating(deferred):
            entry_gradients = self.exchange.wait()
            apply_gradients(
                tables,
                deferred.routes.serve,
                entry_gradients,
                deferred.optimizer,
                deferred.step,
                deferred.part,
            )
        deferred.record.add_background(channel.meter.take())


def _start_gradients(
    tables: Sequence[TableShard], channel: Channel, deferred: DeferredGradients
) -> _StartedGradients:
    routes, part = deferred.routes, deferred.part
    with _updating(deferred):
        gradients = unique_gradients(routes.request, deferred.occurrence_gradients, part)
        exchange = start_gradients(tables, routes, gradients, channel, part)
    return _StartedGradients(deferred, exchange)


def prepare_next(
    tables: Sequence[TableShard],
    shards: Sequence[RowShard],
    channel: Channel,
    host_channel: Channel,
    features: Mapping[str, JaggedTensor] | None,
    current: Routes,
    max_collision_rate: float | None,
    record: StepTelemetry,
    problem: str | None = None,
    deferred: DeferredGradients | None = None,
) -> Prepared | None:
    """Routes step t+1, finds the collision rows of t, plans their update, sends t+1's rows.

    Its ID exchange carries step t's preflight: ``problem`` (this rank's, if its step-t call
    was invalid) or ``features=None`` (step t is the last).

    Args:
        channel: moves rows and gradients, on the tables' device.
        host_channel: moves IDs and plans, on the host: routing and planning read only IDs,
            and on the host nothing they do waits for the GPU (``routing.host_ids``).
        current: step t's routing, on the host.
        deferred: step t-1's gradients outside ``C_t-1``: their AllToAll travels while step t+1
            is routed and planned, and they are applied before any row of step t+1 is read;
            also when routing raises.

    Returns:
        ``None`` when every rank passed ``features=None``.

    Raises:
        EmbeddingInputError: on every rank, if a rank had a problem or the ranks disagree about
            whether step t is the last.
        UpdateLost: if ``deferred`` could not be synced or applied (before any other error).
    """
    channel.meter.take()
    # The IDs' copy first: on a GPU busy with dense kernels, every kernel queued in front of it
    # on this stream (the gradients') would wait for one of them to end.
    ids = None if features is None else host_ids(features, shards)
    started = None if deferred is None else _start_gradients(tables, channel, deferred)
    try:
        host_routes = route(ids, shards, host_channel, problem, final=features is None)
        if host_routes is None:
            return None
        rows = find_collision_rows(host_channel, current, host_routes)
        collisions, unique_rows = rows.collisions, rows.unique_rows
        fallback = max_collision_rate is not None and collisions > max_collision_rate * unique_rows
        host_plan: CollisionPlan | None = None
        if not fallback and collisions:
            host_plan = plan_collisions(tables, host_channel, current, host_routes, rows)
        # One copy per dtype of everything the device needs.
        routes, plan = to_device((host_routes, host_plan), channel.device)
    finally:
        record.add_background(channel.meter.take())
        if started is not None:
            started.finish(tables, channel)
    if fallback:
        values: list[torch.Tensor] = []  # step t+1's forward fetches every row
    elif plan is None:
        values = send_rows(tables, routes, channel)  # every row is final already
    else:
        # Pending rows come as they are before step t's update, with their optimizer state:
        # step t+1's forward applies step t's update to them here (``collisions``).
        values, plan.states = send_rows_with_state(tables, routes, channel, plan.pending)

    record.collision_pct = 100.0 * collisions / unique_rows if unique_rows else 0.0
    record.lookup = "fallback" if fallback else "prefetched"
    record.add_background(channel.meter.take())
    prepared = Prepared(
        routes=routes,
        host_routes=host_routes,
        values=values,
        collisions=collisions,
        unique_rows=unique_rows,
        fallback=fallback,
        plan=plan,
        record=record,
    )
    record.prefetch_bytes = prepared.nbytes()
    return prepared


def finish_gradients(
    tables: Sequence[TableShard], channel: Channel, deferred: DeferredGradients
) -> None:
    """Syncs and applies ``deferred`` on its own (when no step t+1 is prepared with it).

    Raises:
        UpdateLost: if that fails.
    """
    channel.meter.take()
    _start_gradients(tables, channel, deferred).finish(tables, channel)
