"""Prioritized mode's background half: prefetching step t+1 and finishing step t's gradient sync.

With ``R_t`` the rows of step t over all ranks and ``C_t = R_t ∩ R_t+1`` its collision rows:

- ``prepare_next`` (during step t, on the prefetch thread): routes step t+1's IDs (that exchange
  carries step t's preflight), finds ``C_t`` on each owner, plans the collision update
  (``collisions``: who sends which gradient to whom) and sends every row of t+1, with the
  optimizer state of the rows of ``C_t``. Step t does not change those rows before its
  backward, and every earlier update of them has already run.
- the training thread's backward of step t then sends the gradients of ``C_t`` in one AllToAll,
  and step t+1's forward applies them on the owners and, identically, to the prefetched copies
  of t+1, so it has every row at hand, and
- ``finish_gradients`` (during step t+1, on the prefetch thread) syncs and applies the rest of
  step t's gradients, rows that step t+1 does not read, before step t+2's prefetch reads them.

``finish_gradients`` of step t is submitted at the start of step t+1, so it never competes with
step t's critical-path collective.

One thread runs these tasks in submission order on its own process group, so they never
interleave with the training thread's collectives. The two threads never touch the tables at
the same time: the training thread reads or writes rows only when the prefetch thread has
nothing left to do (it waits for the prefetch of the next step before applying collision
updates; a fallback step reads its rows at the start of its forward, before the deferred sync
is submitted).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from freescale_balance import JaggedTensor
from freescale_embed._ops import indices_and_values, isin_sorted
from freescale_embed.channel import Channel
from freescale_embed.collisions import CollisionPlan, plan_collisions
from freescale_embed.optim import Optimizer
from freescale_embed.routing import Routes, route
from freescale_embed.sharding import RowShard
from freescale_embed.tables import TableShard
from freescale_embed.telemetry import StepTelemetry
from freescale_embed.transfers import (
    Part,
    apply_gradients,
    send_gradients,
    send_rows,
    send_rows_with_state,
    unique_gradients,
)


@dataclass
class Prepared:
    """Step t+1 as prepared during step t.

    Attributes:
        routes: step t+1's routing.
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
    values: list[torch.Tensor]
    collisions: int
    unique_rows: int
    fallback: bool
    plan: CollisionPlan | None
    record: StepTelemetry

    @property
    def rest(self) -> Part | None:
        """The part of step t that ``finish_gradients`` syncs (``None``: all of it)."""
        return None if self.plan is None else self.plan.others

    def nbytes(self) -> int:
        """Bytes held between the steps: prefetched rows, routing and plans."""
        planned = 0 if self.plan is None else self.plan.nbytes()
        rows = sum(t.numel() * t.element_size() for t in self.values)
        return self.routes.nbytes() + planned + rows


def prepare_next(
    tables: Sequence[TableShard],
    shards: Sequence[RowShard],
    channel: Channel,
    features: Mapping[str, JaggedTensor] | None,
    current: Routes,
    max_collision_rate: float | None,
    record: StepTelemetry,
    problem: str | None = None,
) -> Prepared | None:
    """Routes step t+1, finds the collision rows of t, plans their update, sends t+1's rows.

    Its ID exchange carries step t's preflight: ``problem`` (this rank's, if its step-t call
    was invalid) or ``features=None`` (step t is the last).

    Returns:
        ``None`` when every rank passed ``features=None``.

    Raises:
        EmbeddingInputError: on every rank, if a rank had a problem or the ranks disagree about
            whether step t is the last.
    """
    channel.meter.take()
    routes = route(features, shards, channel, problem, final=features is None)
    if routes is None:
        return None
    serve = routes.serve
    # Both sides' rows are sorted and unique.
    collided_rows = [
        isin_sorted(rows_t, rows_n)
        for rows_t, rows_n in zip(current.serve.rows, serve.rows, strict=True)
    ]
    pending_rows = [
        isin_sorted(rows_n, rows_t)
        for rows_t, rows_n in zip(current.serve.rows, serve.rows, strict=True)
    ]
    # Summed on the device: one host read for the gathered counts, not one per table.
    collided = torch.zeros((), dtype=torch.int64, device=channel.device)
    for mask in collided_rows:
        collided = collided + mask.sum()
    # torch.full launches a fill: a tensor made from a host value would wait for the stream.
    local_counts = torch.stack(
        [collided, torch.full_like(collided, sum(r.numel() for r in serve.rows))]
    )
    # One read for the gathered counts and the owner's collision rows (which the plan needs).
    owner_rows, (totals,) = indices_and_values(
        [*collided_rows, *pending_rows], [channel.all_gather(local_counts).sum(0)]
    )
    collisions, unique_rows = totals
    fallback = max_collision_rate is not None and collisions > max_collision_rate * unique_rows
    plan: CollisionPlan | None = None
    if fallback:
        values: list[torch.Tensor] = []  # step t+1's forward fetches every row
    elif collisions == 0:
        values = send_rows(tables, routes, channel)  # every row is final already
    else:
        plan = plan_collisions(
            tables, channel, current, routes, collided_rows, pending_rows, owner_rows
        )
        # Pending rows come as they are before step t's update, with their optimizer state:
        # step t+1's forward applies step t's update to them here (``collisions``).
        values, plan.states = send_rows_with_state(tables, routes, channel, plan.pending)

    record.collision_pct = 100.0 * collisions / unique_rows if unique_rows else 0.0
    record.lookup = "fallback" if fallback else "prefetched"
    record.add_background(channel.meter.take())
    prepared = Prepared(
        routes=routes,
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
    tables: Sequence[TableShard],
    channel: Channel,
    routes: Routes,
    occurrence_gradients: Sequence[torch.Tensor],
    prepared: Prepared,
    optimizer: Optimizer,
    step: int,
    record: StepTelemetry,
) -> None:
    """Syncs and applies step t's gradients of rows outside ``C_t`` (step t+1 does not read them).

    ``optimizer`` and ``step`` are those of step t, captured when its backward ran, so a learning
    rate changed since then does not leak into this update.
    """
    channel.meter.take()
    part = prepared.rest
    gradients = unique_gradients(routes.request, occurrence_gradients, part)
    entry_gradients = send_gradients(tables, routes, gradients, channel, part)
    apply_gradients(tables, routes.serve, entry_gradients, optimizer, step, part)
    record.add_background(channel.meter.take())
