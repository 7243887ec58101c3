"""Prioritized mode's collision rows: planned during step t, their gradients sent in its backward
in one AllToAll, the update applied wherever the rows are needed before step t+1 reads them.

With ``C_t = R_t ∩ R_t+1``, step t+1 must read the rows of ``C_t`` as step t's update leaves them.
Sending step t's gradients to the owners and the updated rows back would put two round trips on
the critical path. Instead every rank that needs an updated row applies the update itself:

- during step t, on the prefetch thread (``collision_plan``), each owner tells the ranks that
  read a row of ``C_t`` at step t (its *sources*) which ranks read it at step t+1 (its
  *requesters*), and tells those requesters which sources will send a gradient for it; the
  requesters then receive the row and its optimizer state as they are before step t's update
  (nothing changes them before step t's backward);
- in step t's backward, on the training thread (``send_collision_gradients``), each source
  starts sending its gradient of each of its collision rows to the owner and to every requester
  of the row, in one AllToAll; at the start of step t+1's forward (``apply_collisions``) the
  owner (in its table) and every requester (in its prefetched copy) add the sources' gradients
  in rank order and apply the same optimizer step. Same inputs, same element-wise operations:
  every copy gets the owner's bits, which are synchronous training's. The AllToAll moves while
  the caller runs what lies between a backward and the next forward (its dense optimizer step).

Between a pair of ranks, rows go table by table in ascending ID order, so both sides know the
layout of every message without sending IDs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from freescale_embed._ops import segment_sum
from freescale_embed.channel import Channel
from freescale_embed.collision_plan import CollisionPlan
from freescale_embed.optim import Optimizer
from freescale_embed.routing import Request
from freescale_embed.tables import TableShard
from freescale_embed.transfers import PendingExchange, start_exchange, unique_gradients


@dataclass
class CollisionUpdate:
    """Step t's collision gradients on their way (``send_collision_gradients``), with what
    ``apply_collisions`` needs to apply them."""

    exchange: PendingExchange
    plan: CollisionPlan
    values: Sequence[torch.Tensor]
    optimizer: Optimizer
    step: int


def send_collision_gradients(
    tables: Sequence[TableShard],
    channel: Channel,
    request: Request,
    occurrence_gradients: Sequence[torch.Tensor],
    plan: CollisionPlan,
    values: Sequence[torch.Tensor],
    optimizer: Optimizer,
    step: int,
) -> CollisionUpdate:
    """Step t's backward for the rows of ``C_t``: starts the one AllToAll of their gradients,
    to their owners and their next-step requesters; ``apply_collisions`` finishes it.

    Args:
        request: step t's routing on this rank.
        occurrence_gradients: per table, step t's gradients of this rank's ID occurrences.
        values: per table, the prefetched rows of step t+1's unique IDs; its pending rows hold
            their pre-update values until ``apply_collisions`` updates them in place.
        optimizer, step: step t's optimizer and step count.
    """
    gradients = unique_gradients(request, occurrence_gradients, plan.collided)
    pending = start_exchange(
        [g.index_select(0, index) for g, index in zip(gradients, plan.send_index, strict=True)],
        [table.embedding_dim for table in tables],
        plan.send_counts,
        plan.recv_counts,
        channel,
    )
    return CollisionUpdate(pending, plan, values, optimizer, step)


def apply_collisions(tables: Sequence[TableShard], update: CollisionUpdate) -> None:
    """Waits for the collision gradients of ``update`` and applies them, on their owners'
    tables and in every requester's prefetched rows of t+1."""
    received = update.exchange.wait()
    plan, world = update.plan, update.exchange.pending.channel.world_size
    for k, table in enumerate(tables):
        rows = received[k]
        owned = plan.owned_rows[k]
        # One gradient per source and row: at most ``world`` rows per segment.
        per_row = segment_sum(
            rows.index_select(0, plan.owned_take[k]), plan.owned_segment[k], owned.numel(), world
        )
        table.apply(update.optimizer, owned, per_row, update.step)
        index = plan.pending.ids[k]
        if index.numel():
            per_id = segment_sum(
                rows.index_select(0, plan.pending_take[k]),
                plan.pending_segment[k],
                index.numel(),
                world,
            )
            values = update.values[k]
            copy = values.index_select(0, index)
            positions = torch.arange(index.numel(), device=index.device)
            update.optimizer.update(copy, plan.states[k], positions, per_id, update.step)
            values.index_copy_(0, index, copy)
