"""The embedding and gradient AllToAlls of one step, for all of its rows or a masked part.

Masks select the same rows on both sides: a requester mask over its unique IDs (per table) and
the owner's entry mask over what it received. The owner decides them (collision or not) and tells
the requesters, so both sides agree, and the selected rows keep their relative order (owner,
table, ID). With no masks every row of the step moves: that is synchronous training.

Gradients are aggregated twice, each time in a fixed order: over a rank's occurrences of an ID
(in the order of the table's features, then position), then, on the owner, over the ranks that
sent it (rank 0 first). A row's gradient therefore comes out identical whether the row is synced
with all others or in the collision part first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from freescale_embed._ops import pack_by_peer, peer_numel, segment_sum, unpack_by_peer
from freescale_embed.channel import Channel
from freescale_embed.optim import Optimizer
from freescale_embed.routing import Request, Routes, Serve
from freescale_embed.tables import TableShard

Masks = Sequence[torch.Tensor] | None


def _masked_counts(
    counts: torch.Tensor, peers: Sequence[torch.Tensor], mask: Masks
) -> torch.Tensor:
    """``counts`` (entries per peer and table) of only the entries ``mask`` keeps, where
    ``peers[t]`` is the peer of each entry of table ``t``."""
    if mask is None:
        return counts
    world = counts.shape[0]
    # Adding the mask per peer, rather than counting p[m], keeps the count on the device
    # (boolean indexing reads its size back to the host).
    columns = [
        torch.zeros(world, dtype=torch.int64, device=p.device).index_add_(0, p, m.to(torch.int64))
        for p, m in zip(peers, mask, strict=True)
    ]
    return torch.stack(columns, dim=1) if columns else counts


def _select(tensor: torch.Tensor, masks: Masks, table: int) -> torch.Tensor:
    # index_select copies whole rows; boolean indexing is several times slower on CPU.
    return tensor if masks is None else tensor.index_select(0, masks[table].nonzero().flatten())


def exchange(
    parts: Sequence[torch.Tensor],
    widths: Sequence[int],
    send_counts: torch.Tensor,
    recv_counts: torch.Tensor,
    channel: Channel,
) -> list[torch.Tensor]:
    """One AllToAll of ``[rows, width]`` parts (``send_counts[p, j]`` rows of part ``j`` for
    rank ``p``); returns per part what arrived, rank 0's rows first."""
    # One read of both count tables (each read of a device tensor waits for the GPU).
    both = torch.cat([send_counts, recv_counts], dim=1).tolist()
    send_rows = [row[: len(parts)] for row in both]
    recv_rows = [row[len(parts) :] for row in both]
    recv = channel.all_to_all(
        pack_by_peer(parts, send_rows),
        peer_numel(send_rows, widths),
        peer_numel(recv_rows, widths),
    )
    return unpack_by_peer(recv, recv_rows, [(width,) for width in widths])


def send_rows(
    tables: Sequence[TableShard],
    routes: Routes,
    channel: Channel,
    entry_mask: Masks = None,
    request_mask: Masks = None,
) -> list[torch.Tensor]:
    """The embedding AllToAll: owners send current rows, requesters receive them.

    Returns:
        Per table, the rows of the requester's unique IDs selected by ``request_mask`` (all when
        ``None``), in sorted-ID order.
    """
    serve, request = routes.serve, routes.request
    rows = [
        table.weight.index_select(0, _select(local, entry_mask, t))
        for t, (table, local) in enumerate(zip(tables, serve.local, strict=True))
    ]
    return exchange(
        rows,
        [table.shard.table.embedding_dim for table in tables],
        _masked_counts(serve.counts, serve.sources, entry_mask),
        _masked_counts(request.counts, request.owners, request_mask),
        channel,
    )


def send_rows_with_state(
    tables: Sequence[TableShard],
    routes: Routes,
    channel: Channel,
    entry_mask: Sequence[torch.Tensor],
    request_mask: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """``send_rows`` of every row, and in the same AllToAll the optimizer state of the rows the
    masks select.

    Returns:
        Per table, the rows of the requester's unique IDs, and the optimizer state of those
        ``request_mask`` selects.
    """
    serve, request = routes.serve, routes.request
    rows = [
        table.weight.index_select(0, local)
        for table, local in zip(tables, serve.local, strict=True)
    ]
    widths = [table.shard.table.embedding_dim for table in tables]
    send_counts, recv_counts = serve.counts, request.counts
    stateful = bool(tables) and tables[0].state_names
    if stateful:
        rows += [
            table.state_rows(_select(local, entry_mask, t))
            for t, (table, local) in enumerate(zip(tables, serve.local, strict=True))
        ]
        widths += [table.state_width for table in tables]
        send_counts = torch.cat(
            [send_counts, _masked_counts(serve.counts, serve.sources, entry_mask)], dim=1
        )
        recv_counts = torch.cat(
            [recv_counts, _masked_counts(request.counts, request.owners, request_mask)], dim=1
        )
    received = exchange(rows, widths, send_counts, recv_counts, channel)
    if not stateful:
        return received, [{} for _ in tables]
    states = received[len(tables) :]
    return received[: len(tables)], [
        table.split_state(state) for table, state in zip(tables, states, strict=True)
    ]


def unique_gradients(
    request: Request, grads: Sequence[torch.Tensor], mask: Masks = None
) -> list[torch.Tensor]:
    """Per table, the gradient of each unique ID: its occurrences' gradients summed in order.

    Args:
        request: the step's routing on this rank.
        grads: per table, ``[occurrences, dim]`` gradients, in the order of ``request.inverse``.
        mask: per table, the unique IDs wanted (all when ``None``). Only their occurrences are
            summed, which gives the same bits as summing all and selecting (``segment_sum``
            adds a segment's rows in order, apart from other segments).

    Returns:
        Per table, ``[selected IDs, dim]`` in sorted-ID order.
    """
    out = []
    for t, (g, inverse, unique, largest) in enumerate(
        zip(grads, request.inverse, request.unique, request.max_occurrences, strict=True)
    ):
        if mask is not None:
            wanted = mask[t].index_select(0, inverse).nonzero().flatten()
            g, inverse = g.index_select(0, wanted), inverse.index_select(0, wanted)
        out.append(_select(segment_sum(g, inverse, unique.numel(), largest), mask, t))
    return out


def send_gradients(
    tables: Sequence[TableShard],
    routes: Routes,
    gradients: Sequence[torch.Tensor],
    channel: Channel,
    request_mask: Masks = None,
    entry_mask: Masks = None,
) -> list[torch.Tensor]:
    """The gradient AllToAll: requesters send per-ID gradients to owners.

    Args:
        gradients: per table, the gradients of the unique IDs ``request_mask`` selects (as
            ``unique_gradients`` returns them with that mask).

    Returns:
        Per table, the gradient of each owner entry selected by ``entry_mask``, source-major.
    """
    request, serve = routes.request, routes.serve
    return exchange(
        gradients,
        [table.shard.table.embedding_dim for table in tables],
        _masked_counts(request.counts, request.owners, request_mask),
        _masked_counts(serve.counts, serve.sources, entry_mask),
        channel,
    )


def apply_gradients(
    tables: Sequence[TableShard],
    serve: Serve,
    entry_gradients: Sequence[torch.Tensor],
    optimizer: Optimizer,
    step: int,
    entry_mask: Masks = None,
    row_mask: Masks = None,
) -> None:
    """Aggregates entry gradients per row (rank 0's first) and applies the optimizer in place.

    Args:
        entry_gradients: per table, gradients of the entries selected by ``entry_mask``.
        row_mask: per table, which of ``serve.rows`` to update (those the selected entries
            cover); all when ``None``.
    """
    for t, table in enumerate(tables):
        inverse = _select(serve.row_inverse[t], entry_mask, t)
        # A rank sends each of its IDs once: a row has at most one entry per rank.
        per_row = segment_sum(
            entry_gradients[t], inverse, serve.rows[t].numel(), serve.counts.shape[0]
        )
        table.apply(
            optimizer, _select(serve.rows[t], row_mask, t), _select(per_row, row_mask, t), step
        )
