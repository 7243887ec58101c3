"""Planning prioritized mode's collision update, on the prefetch thread during step t
(``collisions`` says why and how the update travels).

Three phases: find ``C_t`` on each owner (``find_collision_rows``); tell each row's sources and
requesters about each other in one AllToAll (``_exchange_peers``); split both steps' rows by
``C_t`` (``_split_parts``) and lay out the gradient messages of step t's backward, per table
(``_table_route``) and then for all tables with one read from the device (``_layout``).

Between a pair of ranks, rows go table by table in ascending ID order, so both sides know the
layout of every message without sending IDs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from freescale_embed._ops import counts_per_bin, indices, indices_and_values, isin_sorted
from freescale_embed.channel import Channel
from freescale_embed.routing import Routes
from freescale_embed.tables import TableShard
from freescale_embed.transfers import Part, exchange


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


class CollisionRows(NamedTuple):
    """On each owner, the rows of ``C_t`` (from host routes).

    Attributes:
        at_current: per table, mask over step t's rows (``Serve.rows``): rows of ``C_t``.
        at_next: per table, mask over step t+1's rows: rows of ``C_t``.
        current_index: per table, the indices of ``at_current``'s set elements.
        next_index: per table, the indices of ``at_next``'s set elements.
        collisions: ``|C_t|`` over all ranks.
        unique_rows: ``|R_t+1|`` over all ranks.
    """

    at_current: list[torch.Tensor]
    at_next: list[torch.Tensor]
    current_index: list[torch.Tensor]
    next_index: list[torch.Tensor]
    collisions: int
    unique_rows: int


def find_collision_rows(host_channel: Channel, current: Routes, routes: Routes) -> CollisionRows:
    """The rows of ``C_t`` on this rank, given step t's (``current``) and step t+1's host
    routes, and their counts over all ranks (one AllGather)."""
    # Both sides' rows are sorted and unique.
    at_current = [
        isin_sorted(rows_t, rows_n)
        for rows_t, rows_n in zip(current.serve.rows, routes.serve.rows, strict=True)
    ]
    at_next = [
        isin_sorted(rows_n, rows_t)
        for rows_t, rows_n in zip(current.serve.rows, routes.serve.rows, strict=True)
    ]
    local_counts = torch.tensor(
        [sum(int(m.sum()) for m in at_current), sum(r.numel() for r in routes.serve.rows)]
    )
    collisions, unique_rows = host_channel.all_gather(local_counts).sum(0).tolist()
    found = indices([*at_current, *at_next])
    tables = len(at_current)
    return CollisionRows(
        at_current, at_next, found[:tables], found[tables:], collisions, unique_rows
    )


class _Peers(NamedTuple):
    """Who reads each row of ``C_t`` at step t and at step t+1, as each side needs it.

    Attributes:
        owned_sources: owner: per table, bool ``[C_t rows owned, world]``: the ranks that read
            each at step t.
        sources_of_next: requester: per table, bool ``[t+1's unique IDs, world]``: the ranks
            that send a gradient of each.
        requesters_of_current: source: per table, bool ``[t's unique IDs, world]``: the ranks
            that read each at step t+1.
    """

    owned_sources: list[torch.Tensor]
    sources_of_next: list[torch.Tensor]
    requesters_of_current: list[torch.Tensor]


class _Parts(NamedTuple):
    """Step t's and step t+1's rows split by ``C_t``."""

    collided: Part  # step t's rows of ``C_t``
    others: Part  # step t's other rows
    pending: Part  # step t+1's rows of ``C_t``


class _TableRoute(NamedTuple):
    """One table's collision-gradient messages, before their layout is read back.

    Attributes:
        destinations: source side, flat by rank then collided ID: where each gradient goes.
        senders: receiver side, flat by source then member: which gradients arrive.
        owned_at: the members (positions in the union of both sets) of the owned rows.
        pending_at: the members of the pending IDs.
        members: positions in that union.
        owned_rows: the local rows of ``C_t`` this rank owns, ascending.
    """

    destinations: torch.Tensor
    senders: torch.Tensor
    owned_at: torch.Tensor
    pending_at: torch.Tensor
    members: int
    owned_rows: torch.Tensor


def plan_collisions(
    tables: Sequence[TableShard],
    channel: Channel,
    current: Routes,
    routes: Routes,
    rows: CollisionRows,
) -> CollisionPlan:
    """Tells sources and requesters of ``C_t`` about each other (one AllToAll) and plans the
    collision-gradient AllToAll of step t's backward.

    Args:
        tables: this rank's table shards.
        channel: the prefetch thread's channel.
        current: step t's routing; ``routes``: step t+1's.
        rows: the rows of ``C_t`` on this rank.
    """
    peers = _exchange_peers(channel, current, routes, rows)
    parts = _split_parts(current, routes, rows, peers)
    world = channel.world_size
    table_routes = [
        _table_route(table, k, world, current, routes, peers, parts)
        for k, table in enumerate(tables)
    ]
    return _layout(table_routes, parts, world)


def _exchange_peers(
    channel: Channel, current: Routes, routes: Routes, rows: CollisionRows
) -> _Peers:
    """Phase 1: each owner tells the sources of its ``C_t`` rows their requesters and the
    requesters their sources, per entry, in one AllToAll of bit-packed rank masks."""
    world = channel.world_size
    serve_t, serve_n = current.serve, routes.serve
    to_requesters, to_sources, owned_sources = [], [], []
    for k, (at_t, at_n) in enumerate(zip(rows.current_index, rows.next_index, strict=True)):
        sources = _peer_matrix(
            serve_t.sources[k], serve_t.row_inverse[k], serve_t.rows[k].numel(), world
        )
        requesters = _peer_matrix(
            serve_n.sources[k], serve_n.row_inverse[k], serve_n.rows[k].numel(), world
        )
        # Both select C_t's rows in ascending order, so they pair up one to one.
        owned_sources.append(sources.index_select(0, at_t))
        sources_of_n = torch.zeros_like(requesters).index_copy_(0, at_n, owned_sources[-1])
        requesters_of_t = torch.zeros_like(sources).index_copy_(
            0, at_t, requesters.index_select(0, at_n)
        )
        to_requesters.append(pack_bits(sources_of_n.index_select(0, serve_n.row_inverse[k])))
        to_sources.append(pack_bits(requesters_of_t.index_select(0, serve_t.row_inverse[k])))
    width = -(-world // 8)
    messages = [*to_requesters, *to_sources]
    received = exchange(
        messages,
        [width] * len(messages),
        [n + t for n, t in zip(serve_n.host_counts, serve_t.host_counts, strict=True)],
        [
            n + t
            for n, t in zip(routes.request.host_counts, current.request.host_counts, strict=True)
        ],
        channel,
    )
    masks = [unpack_bits(m, world) for m in received]
    tables = len(owned_sources)
    return _Peers(owned_sources, masks[:tables], masks[tables:])


def _split_parts(current: Routes, routes: Routes, rows: CollisionRows, peers: _Peers) -> _Parts:
    """Phase 2: step t's rows in and outside ``C_t``, and step t+1's rows in it, on both sides
    (one read from the device)."""
    collided_ids = [requesters.any(1) for requesters in peers.requesters_of_current]
    collided_entries = [
        m.index_select(0, inverse)
        for m, inverse in zip(rows.at_current, current.serve.row_inverse, strict=True)
    ]
    pending_entries = [
        m.index_select(0, inverse)
        for m, inverse in zip(rows.at_next, routes.serve.row_inverse, strict=True)
    ]
    collided, others, pending = Part.many(
        [
            (current, collided_ids, collided_entries, rows.at_current),
            (
                current,
                [~m for m in collided_ids],
                [~m for m in collided_entries],
                [~m for m in rows.at_current],
            ),
            (
                routes,
                [sources.any(1) for sources in peers.sources_of_next],
                pending_entries,
                rows.at_next,
            ),
        ]
    )
    return _Parts(collided, others, pending)


def _table_route(
    table: TableShard,
    k: int,
    world: int,
    current: Routes,
    routes: Routes,
    peers: _Peers,
    parts: _Parts,
) -> _TableRoute:
    """Phase 3, per table: the nonzeros to find on both sides of the gradient messages."""
    # Source side: each collided ID of t goes to its owner and to its requesters of t+1.
    at = parts.collided.ids[k]
    destinations = peers.requesters_of_current[k].index_select(0, at)
    owners = current.request.owners[k].index_select(0, at)
    destinations.index_put_(
        (torch.arange(at.numel(), device=at.device), owners),
        torch.ones_like(owners, dtype=torch.bool),
    )
    # Receiver side: gradients of the C_t rows this rank owns and of its pending IDs, from
    # each of their sources, in (source, ID) order.
    pending_index = parts.pending.ids[k]
    pending_ids = routes.request.unique[k].index_select(0, pending_index)
    owned_rows = current.serve.rows[k].index_select(0, parts.collided.rows[k])
    owned_at, pending_at = _merge_positions(owned_rows + table.shard.start, pending_ids)
    members = owned_at.numel() + pending_at.numel()
    senders = torch.zeros(members, world, dtype=torch.bool, device=owned_at.device)
    senders.index_copy_(0, owned_at, peers.owned_sources[k])
    senders.index_copy_(
        0,
        pending_at,
        senders.index_select(0, pending_at)
        | peers.sources_of_next[k].index_select(0, pending_index),
    )
    return _TableRoute(
        destinations=destinations.t().reshape(-1),  # by rank, then ID
        senders=senders.t().reshape(-1),  # by source, then ID
        owned_at=owned_at,
        pending_at=pending_at,
        members=members,
        owned_rows=owned_rows,
    )


def _layout(table_routes: Sequence[_TableRoute], parts: _Parts, world: int) -> CollisionPlan:
    """Phase 3, all tables: the message sizes and the segments of received rows, read back
    here, on the prefetch thread, so that the backward's exchange reads nothing back."""
    tables = len(table_routes)
    found = indices([*(r.destinations for r in table_routes), *(r.senders for r in table_routes)])
    send_index, send_counts_k, recv_counts_k, segment_masks, segments = [], [], [], [], []
    for k, table_route in enumerate(table_routes):
        sent = max(1, parts.collided.ids[k].numel())
        send_index.append(found[k] % sent)
        send_counts_k.append(counts_per_bin(found[k] // sent, world))
        members = max(1, table_route.members)
        source, member = found[tables + k] // members, found[tables + k] % members
        recv_counts_k.append(counts_per_bin(source, world))
        for position in (table_route.owned_at, table_route.pending_at):
            segment = _segment_of(position, member, table_route.members)
            segment_masks.append(segment >= 0)
            segments.append(segment)
    takes, (send_counts, recv_counts) = indices_and_values(
        segment_masks,
        [torch.stack(send_counts_k, dim=1), torch.stack(recv_counts_k, dim=1)],
    )
    segments = [s.index_select(0, take) for s, take in zip(segments, takes, strict=True)]
    return CollisionPlan(
        collided=parts.collided,
        others=parts.others,
        pending=parts.pending,
        send_index=send_index,
        send_counts=send_counts,
        recv_counts=recv_counts,
        owned_rows=[r.owned_rows for r in table_routes],
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
