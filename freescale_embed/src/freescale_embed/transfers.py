"""The embedding and gradient AllToAlls of one step, for all of its rows or a selected part.

A part is selected on both sides by ascending indices per table (``Part``): the requester's
unique IDs and their occurrences, the owner's entries (what requesters sent it) and rows. The
owner decides the part (collision or not) and tells the requesters, so both sides agree, and the
selected rows keep their relative order (owner, table, ID). With no part every row of the step
moves: that is synchronous training.

Gradients are aggregated twice, each time in a fixed order: over a rank's occurrences of an ID
(in the order of the table's features, then position), then, on the owner, over the ranks that
sent it (rank 0 first). A row's gradient therefore comes out identical whether the row is synced
with all others or in the collision part first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from freescale_embed._ops import (
    counts_per_bin,
    indices_and_values,
    pack_by_peer,
    peer_numel,
    segment_sum,
    unpack_by_peer,
)
from freescale_embed.channel import Channel, PendingAllToAll
from freescale_embed.optim import Optimizer
from freescale_embed.routing import Request, Routes, Serve
from freescale_embed.tables import TableShard


@dataclass(frozen=True)
class Part:
    """A part of one step's rows, as ascending indices per table on both sides.

    Attributes:
        ids: requester: indices into ``Request.unique``.
        occurrences: requester: indices of the ID occurrences whose ID is in ``ids``.
        entries: owner: indices of the received entries of those IDs.
        rows: owner: indices into ``Serve.rows`` of those IDs.
        request_counts: ``[world][tables]``, requester: IDs of ``ids`` per owner (on the host).
        serve_counts: ``[world][tables]``, owner: entries of ``entries`` per source.
    """

    ids: list[torch.Tensor]
    occurrences: list[torch.Tensor]
    entries: list[torch.Tensor]
    rows: list[torch.Tensor]
    request_counts: list[list[int]]
    serve_counts: list[list[int]]

    @staticmethod
    def many(
        selections: Sequence[
            tuple[Routes, Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor]]
        ],
    ) -> list[Part]:
        """Per ``(routes, id_masks, entry_masks, row_masks)``, the part that masks over the
        requester's unique IDs and the owner's entries and rows select; one read from the
        device for all of them (their counts per peer included)."""
        masks: list[torch.Tensor] = []
        counts: list[torch.Tensor] = []
        for routes, id_masks, entry_masks, row_masks in selections:
            request, serve = routes.request, routes.serve
            occurrence_masks = [
                m.index_select(0, inverse)
                for m, inverse in zip(id_masks, request.inverse, strict=True)
            ]
            masks += [*id_masks, *occurrence_masks, *entry_masks, *row_masks]
            counts.append(_counts_of(id_masks, request.owners, len(request.host_counts)))
            counts.append(_counts_of(entry_masks, serve.sources, len(serve.host_counts)))
        found_list, host_counts = indices_and_values(masks, counts)
        found, per_peer = iter(found_list), iter(host_counts)
        return [
            Part(
                *([next(found) for _ in id_masks] for _ in range(4)), next(per_peer), next(per_peer)
            )
            for _, id_masks, _, _ in selections
        ]

    def nbytes(self) -> int:
        tensors = [*self.ids, *self.occurrences, *self.entries, *self.rows]
        return sum(t.numel() * t.element_size() for t in tensors)


def _counts_of(
    masks: Sequence[torch.Tensor], peers: Sequence[torch.Tensor], world: int
) -> torch.Tensor:
    """``[world, tables]``: per peer, the set elements of each table's mask, where
    ``peers[t]`` is the peer of each element of table ``t``."""
    columns = [counts_per_bin(p, world, m) for m, p in zip(masks, peers, strict=True)]
    return torch.stack(columns, dim=1)


def _select(
    tensor: torch.Tensor, selected: Sequence[torch.Tensor] | None, table: int
) -> torch.Tensor:
    return tensor if selected is None else tensor.index_select(0, selected[table])


def exchange(
    parts: Sequence[torch.Tensor],
    widths: Sequence[int],
    send_counts: list[list[int]],
    recv_counts: list[list[int]],
    channel: Channel,
) -> list[torch.Tensor]:
    """One AllToAll of ``[rows, width]`` parts (``send_counts[p][j]`` rows of part ``j`` for
    rank ``p``, on the host); returns per part what arrived, rank 0's rows first."""
    recv = channel.all_to_all(*_packed(parts, widths, send_counts, recv_counts))
    return _unpacked(recv, recv_counts, widths)


def _packed(
    parts: Sequence[torch.Tensor],
    widths: Sequence[int],
    send_counts: list[list[int]],
    recv_counts: list[list[int]],
) -> tuple[torch.Tensor, list[int], list[int]]:
    """An exchange's AllToAll buffer and its send and receive splits."""
    send_splits, recv_splits = peer_numel(send_counts, widths), peer_numel(recv_counts, widths)
    return pack_by_peer(parts, send_counts), send_splits, recv_splits


def _unpacked(
    recv: torch.Tensor, recv_counts: list[list[int]], widths: Sequence[int]
) -> list[torch.Tensor]:
    return unpack_by_peer(recv, recv_counts, [(width,) for width in widths])


@dataclass
class PendingExchange:
    """An ``exchange`` under way (``start_exchange``)."""

    pending: PendingAllToAll
    recv_counts: list[list[int]]
    widths: Sequence[int]

    def wait(self) -> list[torch.Tensor]:
        """Per part, what arrived (see ``PendingAllToAll.wait``)."""
        return _unpacked(self.pending.wait(), self.recv_counts, self.widths)


def start_exchange(
    parts: Sequence[torch.Tensor],
    widths: Sequence[int],
    send_counts: list[list[int]],
    recv_counts: list[list[int]],
    channel: Channel,
) -> PendingExchange:
    """``exchange`` (count tables on the host) without waiting for it."""
    pending = channel.start_all_to_all(*_packed(parts, widths, send_counts, recv_counts))
    return PendingExchange(pending, recv_counts, widths)


def send_rows(tables: Sequence[TableShard], routes: Routes, channel: Channel) -> list[torch.Tensor]:
    """The embedding AllToAll: owners send current rows, requesters receive them.

    Returns:
        Per table, the rows of the requester's unique IDs, in sorted-ID order.
    """
    rows, _ = send_rows_with_state(tables, routes, channel, None)
    return rows


def send_rows_with_state(
    tables: Sequence[TableShard],
    routes: Routes,
    channel: Channel,
    stateful: Part | None,
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """``send_rows``, and in the same AllToAll the optimizer state of the ``stateful`` part's
    rows (its ``ids`` and ``entries``).

    Returns:
        Per table, the rows of the requester's unique IDs, and the optimizer state of those in
        ``stateful.ids`` (empty without a part or with a stateless optimizer).
    """
    serve, request = routes.serve, routes.request
    rows = [
        table.weight.index_select(0, local)
        for table, local in zip(tables, serve.local, strict=True)
    ]
    widths = [table.embedding_dim for table in tables]
    if stateful is None or not tables[0].state_names:
        received = exchange(rows, widths, serve.host_counts, request.host_counts, channel)
        return received, [{} for _ in tables]
    states = [
        table.state_rows(local.index_select(0, entries))
        for table, local, entries in zip(tables, serve.local, stateful.entries, strict=True)
    ]
    received = exchange(
        [*rows, *states],
        [*widths, *(table.state_width for table in tables)],
        [s + p for s, p in zip(serve.host_counts, stateful.serve_counts, strict=True)],
        [r + p for r, p in zip(request.host_counts, stateful.request_counts, strict=True)],
        channel,
    )
    count = len(tables)
    return received[:count], [
        table.split_state(state) for table, state in zip(tables, received[count:], strict=True)
    ]


def unique_gradients(
    request: Request, grads: Sequence[torch.Tensor], part: Part | None = None
) -> list[torch.Tensor]:
    """Per table, the gradient of each unique ID: its occurrences' gradients summed in order.

    Args:
        request: the step's routing on this rank.
        grads: per table, ``[occurrences, dim]`` gradients, in the order of ``request.inverse``.
        part: the unique IDs wanted (all when ``None``). Only their occurrences are summed,
            which gives the same bits as summing all and selecting (``segment_sum`` adds a
            segment's rows in order, apart from other segments).

    Returns:
        Per table, ``[selected IDs, dim]`` in sorted-ID order.
    """
    out = []
    for t, (g, inverse, unique, largest) in enumerate(
        zip(grads, request.inverse, request.unique, request.max_occurrences, strict=True)
    ):
        if part is not None:
            wanted = part.occurrences[t]
            g, inverse = g.index_select(0, wanted), inverse.index_select(0, wanted)
        summed = segment_sum(g, inverse, unique.numel(), largest)
        out.append(_select(summed, None if part is None else part.ids, t))
    return out


def send_gradients(
    tables: Sequence[TableShard],
    routes: Routes,
    gradients: Sequence[torch.Tensor],
    channel: Channel,
    part: Part | None = None,
) -> list[torch.Tensor]:
    """The gradient AllToAll: requesters send per-ID gradients to owners.

    Args:
        gradients: per table, the gradients of the part's unique IDs (as ``unique_gradients``
            returns them for that part).

    Returns:
        Per table, the gradient of each of the part's owner entries, source-major.
    """
    return exchange(gradients, *_gradient_layout(tables, routes, part), channel)


def start_gradients(
    tables: Sequence[TableShard],
    routes: Routes,
    gradients: Sequence[torch.Tensor],
    channel: Channel,
    part: Part | None = None,
) -> PendingExchange:
    """``send_gradients`` without waiting for it."""
    return start_exchange(gradients, *_gradient_layout(tables, routes, part), channel)


def _gradient_layout(
    tables: Sequence[TableShard], routes: Routes, part: Part | None
) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """A gradient exchange's widths and its send and receive count tables."""
    request, serve = routes.request, routes.serve
    widths = [table.embedding_dim for table in tables]
    if part is None:
        return widths, request.host_counts, serve.host_counts
    return widths, part.request_counts, part.serve_counts


def apply_gradients(
    tables: Sequence[TableShard],
    serve: Serve,
    entry_gradients: Sequence[torch.Tensor],
    optimizer: Optimizer,
    step: int,
    part: Part | None = None,
) -> None:
    """Aggregates entry gradients per row (rank 0's first) and applies the optimizer in place.

    Args:
        entry_gradients: per table, gradients of the part's entries (all when ``None``).
        part: the entries received and the rows they cover.
    """
    entries, rows = (None, None) if part is None else (part.entries, part.rows)
    for t, table in enumerate(tables):
        inverse = _select(serve.row_inverse[t], entries, t)
        # A rank sends each of its IDs once: a row has at most one entry per rank.
        per_row = segment_sum(
            entry_gradients[t], inverse, serve.rows[t].numel(), len(serve.host_counts)
        )
        table.apply(optimizer, _select(serve.rows[t], rows, t), _select(per_row, rows, t), step)


def sync_gradients(
    tables: Sequence[TableShard],
    routes: Routes,
    occurrence_gradients: Sequence[torch.Tensor],
    channel: Channel,
    optimizer: Optimizer,
    step: int,
) -> None:
    """A synchronous backward of every row of a step: per-ID sums, the gradient AllToAll to the
    owners, and the optimizer there."""
    gradients = unique_gradients(routes.request, occurrence_gradients)
    entry_gradients = send_gradients(tables, routes, gradients, channel)
    apply_gradients(tables, routes.serve, entry_gradients, optimizer, step)
