"""Prioritized mode's collision rows: planned during step t, their gradients sent in its backward
in one AllToAll, the update applied wherever the rows are needed before step t+1 reads them.

With ``C_t = R_t ∩ R_t+1``, step t+1 must read the rows of ``C_t`` as step t's update leaves them.
Sending step t's gradients to the owners and the updated rows back would put two round trips on
the critical path. Instead every rank that needs an updated row applies the update itself:

- during step t, on the prefetch thread (``plan_collisions``), each owner tells the ranks that
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
from dataclasses import dataclass, field

import torch

from freescale_embed._ops import (
    counts_per_bin,
    indices,
    indices_and_values,
    segment_sum,
)
from freescale_embed.channel import Channel
from freescale_embed.optim import Optimizer
from freescale_embed.routing import Request, Routes
from freescale_embed.tables import TableShard
from freescale_embed.transfers import (
    Part,
    PendingExchange,
    exchange,
    start_exchange,
    unique_gradients,
)


@dataclass
class CollisionPlan:
    """Where step t's collision gradients go and where they apply, on this rank.

    Attributes:
        collided: the rows of ``C_t`` in step t's routing (this rank's IDs and occurrences of
            them; the entries and rows of them it owns).
        others: the rows of step t outside ``C_t`` (synced in the background during step t+1).
        pending: the rows of ``C_t`` in step t+1's routing.
        send_index: per table, rows of the collision gradients (the collided IDs, ascending) in
            send order: by destination rank, then ID.
        send_counts: ``[world][tables]``, gradient rows sent to each rank (on the host).
        recv_counts: ``[world][tables]``, gradient rows received from each rank.
        owned_rows: per table, the local rows of ``C_t`` this rank owns, ascending.
        owned_take: per table, the received rows that are gradients of ``owned_rows``.
        owned_segment: per table, the index in ``owned_rows`` of each of them.
        pending_take: per table, the received rows that are gradients of pending IDs.
        pending_segment: per table, the index in ``pending.ids`` of each of them.
        states: per table, the optimizer state of the pending IDs before step t's update
            (filled by the prefetch's row exchange).
    """

    collided: Part
    others: Part
    pending: Part
    send_index: list[torch.Tensor]
    send_counts: list[list[int]]
    recv_counts: list[list[int]]
    owned_rows: list[torch.Tensor]
    owned_take: list[torch.Tensor]
    owned_segment: list[torch.Tensor]
    pending_take: list[torch.Tensor]
    pending_segment: list[torch.Tensor]
    states: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def nbytes(self) -> int:
        tensors = [
            *self.send_index,
            *self.owned_rows,
            *self.owned_take,
            *self.owned_segment,
            *self.pending_take,
            *self.pending_segment,
            *(t for state in self.states for t in state.values()),
        ]
        own = sum(t.numel() * t.element_size() for t in tensors)
        parts = (self.collided, self.others, self.pending)
        return own + sum(part.nbytes() for part in parts)


def _peer_matrix(
    peers: torch.Tensor, row_inverse: torch.Tensor, rows: int, world: int
) -> torch.Tensor:
    """bool ``[rows, world]``: which ranks sent an entry of each row."""
    matrix = torch.zeros(rows, world, dtype=torch.bool, device=peers.device)
    matrix.index_put_((row_inverse, peers), torch.ones_like(peers, dtype=torch.bool))
    return matrix


def pack_bits(matrix: torch.Tensor) -> torch.Tensor:
    """bool ``[n, world]`` as uint8 ``[n, ceil(world / 8)]``: rank ``8j + b`` is bit ``b`` of
    byte ``j``."""
    rows, world = matrix.shape
    width = -(-world // 8)
    padded = torch.nn.functional.pad(matrix.to(torch.int64), (0, 8 * width - world))
    shifts = torch.arange(8, device=matrix.device)
    return (padded.reshape(rows, width, 8) << shifts).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, world: int) -> torch.Tensor:
    """Inverse of ``pack_bits``."""
    shifts = torch.arange(8, device=packed.device)
    bits = (packed.to(torch.int64)[..., None] >> shifts) & 1
    return bits.reshape(packed.shape[0], 8 * packed.shape[1])[:, :world].to(torch.bool)


def plan_collisions(
    tables: Sequence[TableShard],
    channel: Channel,
    current: Routes,
    routes: Routes,
    collided_rows: Sequence[torch.Tensor],
    pending_rows: Sequence[torch.Tensor],
    owner_rows: Sequence[torch.Tensor],
) -> CollisionPlan:
    """Tells sources and requesters of ``C_t`` about each other (one AllToAll) and plans the
    collision-gradient AllToAll of step t's backward.

    Args:
        tables: this rank's table shards.
        channel: the prefetch thread's channel.
        current: step t's routing; ``routes``: step t+1's.
        collided_rows: per table, owner mask over step t's rows: rows of ``C_t``.
        pending_rows: per table, owner mask over step t+1's rows: rows of ``C_t``.
        owner_rows: the indices of both masks' set elements, ``collided_rows``' first.
    """
    world = channel.world_size
    serve_t, serve_n = current.serve, routes.serve
    to_requesters, to_sources, owned_sources = [], [], []
    for k in range(len(tables)):
        sources = _peer_matrix(
            serve_t.sources[k], serve_t.row_inverse[k], serve_t.rows[k].numel(), world
        )
        requesters = _peer_matrix(
            serve_n.sources[k], serve_n.row_inverse[k], serve_n.rows[k].numel(), world
        )
        # Both select C_t's rows in ascending order, so they pair up one to one.
        at_t, at_n = owner_rows[k], owner_rows[len(tables) + k]
        owned_sources.append(sources.index_select(0, at_t))
        sources_of_n = torch.zeros_like(requesters).index_copy_(0, at_n, owned_sources[-1])
        requesters_of_t = torch.zeros_like(sources).index_copy_(
            0, at_t, requesters.index_select(0, at_n)
        )
        to_requesters.append(pack_bits(sources_of_n.index_select(0, serve_n.row_inverse[k])))
        to_sources.append(pack_bits(requesters_of_t.index_select(0, serve_t.row_inverse[k])))
    width = -(-world // 8)
    parts = [*to_requesters, *to_sources]
    received = exchange(
        parts,
        [width] * len(parts),
        [n + t for n, t in zip(serve_n.host_counts, serve_t.host_counts, strict=True)],
        [
            n + t
            for n, t in zip(routes.request.host_counts, current.request.host_counts, strict=True)
        ],
        channel,
    )
    masks = [unpack_bits(m, world) for m in received]
    sources_of_pending, requesters_of_collided = masks[: len(tables)], masks[len(tables) :]
    collided_ids = [requesters.any(1) for requesters in requesters_of_collided]
    collided_entries = [
        m.index_select(0, inverse)
        for m, inverse in zip(collided_rows, serve_t.row_inverse, strict=True)
    ]
    pending_entries = [
        m.index_select(0, inverse)
        for m, inverse in zip(pending_rows, serve_n.row_inverse, strict=True)
    ]
    collided, others, pending = Part.many(
        [
            (current, collided_ids, collided_entries, collided_rows),
            (
                current,
                [~m for m in collided_ids],
                [~m for m in collided_entries],
                [~m for m in collided_rows],
            ),
            (
                routes,
                [sources.any(1) for sources in sources_of_pending],
                pending_entries,
                pending_rows,
            ),
        ]
    )

    # Two passes for all tables: the nonzeros of both sides' peer matrices,
    # then the segments of received rows with the message sizes.
    destination_masks, sender_masks, owned_at_k, pending_at_k, members_k = [], [], [], [], []
    owned_rows_k = []
    for k, table in enumerate(tables):
        # Source side: each collided ID of t goes to its owner and to its requesters of t+1.
        at = collided.ids[k]
        destinations = requesters_of_collided[k].index_select(0, at)
        owners = current.request.owners[k].index_select(0, at)
        destinations.index_put_(
            (torch.arange(at.numel(), device=at.device), owners),
            torch.ones_like(owners, dtype=torch.bool),
        )
        destination_masks.append(destinations.t().reshape(-1))  # by rank, then ID

        # Receiver side: gradients of the C_t rows this rank owns and of its pending IDs, from
        # each of their sources, in (source, ID) order.
        pending_index = pending.ids[k]
        pending_ids = routes.request.unique[k].index_select(0, pending_index)
        owned_rows = serve_t.rows[k].index_select(0, collided.rows[k])
        owned_at, pending_at = _merge_positions(owned_rows + table.shard.start, pending_ids)
        members = owned_at.numel() + pending_at.numel()
        senders = torch.zeros(members, world, dtype=torch.bool, device=owned_at.device)
        senders.index_copy_(0, owned_at, owned_sources[k])
        senders.index_copy_(
            0,
            pending_at,
            senders.index_select(0, pending_at)
            | sources_of_pending[k].index_select(0, pending_index),
        )
        sender_masks.append(senders.t().reshape(-1))  # by source, then ID
        owned_at_k.append(owned_at)
        pending_at_k.append(pending_at)
        members_k.append(members)
        owned_rows_k.append(owned_rows)
    found = indices([*destination_masks, *sender_masks])
    send_index, send_counts_k, recv_counts_k, segment_masks, segments = [], [], [], [], []
    for k in range(len(tables)):
        sent = max(1, collided.ids[k].numel())
        send_index.append(found[k] % sent)
        send_counts_k.append(counts_per_bin(found[k] // sent, world))
        members = max(1, members_k[k])
        source, member = found[len(tables) + k] // members, found[len(tables) + k] % members
        recv_counts_k.append(counts_per_bin(source, world))
        for position in (owned_at_k[k], pending_at_k[k]):
            segment = _segment_of(position, member, members_k[k])
            segment_masks.append(segment >= 0)
            segments.append(segment)
    # Read here, on the prefetch thread, so that the backward's exchange reads nothing back.
    takes, (send_counts, recv_counts) = indices_and_values(
        segment_masks,
        [torch.stack(send_counts_k, dim=1), torch.stack(recv_counts_k, dim=1)],
    )
    segments = [s.index_select(0, take) for s, take in zip(segments, takes, strict=True)]
    return CollisionPlan(
        collided=collided,
        others=others,
        pending=pending,
        send_index=send_index,
        send_counts=send_counts,
        recv_counts=recv_counts,
        owned_rows=owned_rows_k,
        owned_take=takes[0::2],
        owned_segment=segments[0::2],
        pending_take=takes[1::2],
        pending_segment=segments[1::2],
    )


def _merge_positions(
    first: torch.Tensor, second: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of two ascending sets of IDs in their sorted concatenation, an ID in both at
    the same position: the order of their union, without reading its size back (``unique``
    would). The positions are ascending in ID; some positions are nobody's."""
    merged, order = torch.sort(torch.cat([first, second]), stable=True)
    count = merged.numel()
    span = torch.arange(count, device=merged.device)
    starts = torch.ones(count, dtype=torch.bool, device=merged.device)
    starts[1:] = merged[1:] != merged[:-1]
    head = torch.where(starts, span, torch.zeros_like(span)).cummax(0).values
    position = torch.empty_like(span).index_copy_(0, order, head)
    return position[: first.numel()], position[first.numel() :]


def _segment_of(position: torch.Tensor, member: torch.Tensor, members: int) -> torch.Tensor:
    """For each received row ``member`` (a position among ``members``), its index in
    ``position`` (its segment), or -1 if its position is not one of ``position``'s."""
    of_member = torch.full((members,), -1, dtype=torch.int64, device=member.device)
    of_member.index_copy_(0, position, torch.arange(position.numel(), device=member.device))
    return of_member.index_select(0, member)


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
        [table.shard.table.embedding_dim for table in tables],
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
