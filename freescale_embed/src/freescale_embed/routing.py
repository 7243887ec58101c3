"""Where each ID of a step goes: the requester's unique IDs per owner, and the owner's view.

One step's routing is computed once and used by its forward lookup and its gradient sync (and,
in prioritized mode, by the collision bookkeeping of the next step).

Requester side, per table: the IDs of all the table's features (in the table's feature order) are
deduplicated into sorted unique IDs; as owners hold contiguous blocks, sorted IDs are already
grouped by owner, and the send order of every message is (owner, table, ID).

Owner side, per table: the IDs received from ranks 0, 1, ... ("entries", source-major), their local
rows, and the sorted unique rows they touch with each entry's index among them.

Example, 2 ranks, one table of 10 rows (rank 0 owns 0-4, rank 1 owns 5-9)::

    rank 0 looks up [7, 1, 7]  -> unique [1, 7], sends [1] to rank 0 and [7] to rank 1
    rank 1 looks up [7, 8]     -> unique [7, 8], sends [] to rank 0 and [7, 8] to rank 1
    rank 1's entries: [7 (from rank 0), 7, 8 (from rank 1)] -> rows [2, 3], row_inverse [0, 0, 1]

Routing works on the device of the channel it is given. Sync mode routes on the tables' device;
prioritized mode on the host (``host_ids``), where nothing waits for a GPU busy with dense
compute, and moves the result to the device afterwards (``streams.to_device``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from freescale_balance import JaggedTensor
from freescale_embed._ops import counts_per_bin, pack_by_peer, unique_with_inverse, unpack_by_peer
from freescale_embed.channel import Channel
from freescale_embed.inputs import EmbeddingInputError, raise_if_flagged
from freescale_embed.sharding import RowShard

# Each rank's preflight status, in front of its ID counts.
_ROUTE, _BAD, _FINAL = 0, 1, 2


@dataclass(frozen=True)
class Request:
    """The requester side of one step on this rank.

    Attributes:
        unique: per table, sorted unique global IDs this rank looks up.
        inverse: per table, for each ID occurrence (the table's features concatenated in the
            table's feature order), its index in ``unique``.
        owners: per table, owning rank of each unique ID.
        counts: int64 ``[world, tables]``, unique IDs sent to each owner per table.
        occurrences: per feature, how many IDs the batch has (to cut the outputs; known on the
            host, so no device read per feature).
        max_occurrences: per table, the most occurrences of one ID (bounds the gradient
            sums' trees without a device read).
        host_counts: ``counts`` on the host (sizes every message of the step without a read).
    """

    unique: list[torch.Tensor]
    inverse: list[torch.Tensor]
    owners: list[torch.Tensor]
    counts: torch.Tensor
    occurrences: dict[str, int]
    max_occurrences: list[int]
    host_counts: list[list[int]]

    def nbytes(self) -> int:
        tensors = [*self.unique, *self.inverse, *self.owners, self.counts]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class Serve:
    """The owner side of one step on this rank.

    Attributes:
        host_counts: ``[world][tables]``, entries received from each rank per table.
        local: per table, the local row of each entry (entries of rank 0 first, then rank 1, ...).
        sources: per table, the rank each entry came from.
        rows: per table, sorted unique local rows the step touches on this rank.
        row_inverse: per table, each entry's index in ``rows``.
    """

    host_counts: list[list[int]]
    local: list[torch.Tensor]
    sources: list[torch.Tensor]
    rows: list[torch.Tensor]
    row_inverse: list[torch.Tensor]

    def nbytes(self) -> int:
        tensors = [*self.local, *self.sources, *self.rows, *self.row_inverse]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class Routes:
    """Both sides of one step's routing."""

    request: Request
    serve: Serve

    def nbytes(self) -> int:
        return self.request.nbytes() + self.serve.nbytes()


def host_ids(
    features: Mapping[str, JaggedTensor], shards: Sequence[RowShard]
) -> dict[str, torch.Tensor]:
    """The IDs of every table feature as int64 on the host, in one copy from the device (one
    wait for it) for all features: routing reads only IDs, and on the host nothing it does
    waits for the GPU."""
    names = [name for shard in shards for name in shard.table.feature_names]
    values = [features[name].values.to(torch.int64) for name in names]
    if not values or values[0].device.type == "cpu":
        return dict(zip(names, values, strict=True))
    host = torch.cat(values).cpu().split([v.numel() for v in values])
    return dict(zip(names, host, strict=True))


def build_request(
    ids: Mapping[str, torch.Tensor], shards: Sequence[RowShard], device: torch.device
) -> Request:
    """Deduplicates one step's IDs (per feature, on ``device``) per table and groups them by
    owner (local work only)."""
    world = shards[0].world_size if shards else 1
    unique, inverse, owners, counts, largest = [], [], [], [], []
    for shard in shards:
        parts = [ids[name].to(torch.int64) for name in shard.table.feature_names]
        table_ids = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=device)
        table_unique, table_inverse, table_counts = unique_with_inverse(table_ids)
        table_owners = shard.owners(table_unique)
        unique.append(table_unique)
        inverse.append(table_inverse)
        owners.append(table_owners)
        counts.append(counts_per_bin(table_owners, world))
        largest.append(table_counts.max() if table_counts.numel() else table_counts.new_zeros(()))
    table = (
        torch.stack(counts, dim=1)
        if counts
        else torch.zeros(world, 0, dtype=torch.int64, device=device)
    )
    # One read for the count table and the largest counts.
    read = torch.cat([table.flatten(), *(m.reshape(1) for m in largest)]).tolist()
    tables = len(shards)
    return Request(
        unique=unique,
        inverse=inverse,
        owners=owners,
        counts=table,
        occurrences={
            name: ids[name].numel() for shard in shards for name in shard.table.feature_names
        },
        max_occurrences=read[world * tables :],
        host_counts=[read[r * tables : (r + 1) * tables] for r in range(world)],
    )


def empty_request(shards: Sequence[RowShard], world: int, device: torch.device) -> Request:
    """A request for no IDs (what a rank with invalid input sends in the preflight)."""
    nothing = [torch.empty(0, dtype=torch.int64, device=device) for _ in shards]
    counts = torch.zeros(world, len(shards), dtype=torch.int64, device=device)
    host_counts = [[0] * len(shards) for _ in range(world)]
    return Request(nothing, nothing, nothing, counts, {}, [0] * len(shards), host_counts)


def exchange_ids(
    request: Request,
    shards: Sequence[RowShard],
    channel: Channel,
    problem: str | None = None,
    final: bool = False,
) -> Serve | None:
    """The ID AllToAll: counts first (each rank's preflight status in front), then the unique IDs.

    Args:
        request: what this rank looks up (empty with a ``problem`` or when ``final``).
        shards: the tables' shards on this rank.
        channel: where the collectives run.
        problem: this rank's input problem, or ``None``.
        final: this rank has no step to route (prioritized mode's last step): when every rank
            says so, nothing more is sent and ``None`` is returned.

    Raises:
        EmbeddingInputError: on every rank, before any ID moves, if some rank has a problem or
            the ranks disagree about ``final``.
    """
    world, num_tables = request.counts.shape
    status = _BAD if problem is not None else _FINAL if final else _ROUTE
    header = torch.cat(
        [
            torch.full((world, 1), status, dtype=torch.int64, device=request.counts.device),
            request.counts,
        ],
        dim=1,
    )
    received = channel.all_to_all(
        header.reshape(-1), [num_tables + 1] * world, [num_tables + 1] * world
    ).reshape(world, num_tables + 1)
    # One read: the statuses, and the counts that size every message below.
    received_header = received.tolist()
    statuses = [row[0] for row in received_header]
    raise_if_flagged(channel, problem, [s == _BAD for s in statuses])
    if _FINAL in statuses:
        if all(s == _FINAL for s in statuses):
            return None
        last = [rank for rank, s in enumerate(statuses) if s == _FINAL]
        raise EmbeddingInputError(
            f"ranks {last} passed final=True but the others a next_batch: every rank must "
            "end at the same step"
        )
    send_counts = request.host_counts
    recv_counts = [row[1:] for row in received_header]
    recv = channel.all_to_all(
        pack_by_peer(request.unique, send_counts),
        [sum(row) for row in send_counts],
        [sum(row) for row in recv_counts],
    )
    ids = unpack_by_peer(recv, recv_counts, [()] * num_tables)
    local, sources, rows, row_inverse = [], [], [], []
    peers = torch.arange(world, device=header.device)
    for t, shard in enumerate(shards):
        table_local = ids[t] - shard.start
        table_rows, table_inverse, _ = unique_with_inverse(table_local)
        local.append(table_local)
        sources.append(
            torch.repeat_interleave(
                peers, received[:, 1 + t], output_size=sum(row[t] for row in recv_counts)
            )
        )
        rows.append(table_rows)
        row_inverse.append(table_inverse)
    return Serve(recv_counts, local, sources, rows, row_inverse)


def route(
    ids: Mapping[str, torch.Tensor] | None,
    shards: Sequence[RowShard],
    channel: Channel,
    problem: str | None = None,
    final: bool = False,
) -> Routes | None:
    """``build_request`` then ``exchange_ids``; with a ``problem``, raises on every rank.

    Args:
        ids: this rank's IDs per feature, on ``channel``'s device (ignored, may be ``None``,
            with a problem or ``final``).
        shards: the tables' shards on this rank.
        channel: where the collectives run (on the host: see ``host_ids``).
        problem: this rank's input problem, or ``None``.
        final: nothing to route on this rank (see ``exchange_ids``); ``None`` is returned when
            every rank says so.
    """
    if problem is None and not final and ids is not None:
        request = build_request(ids, shards, channel.device)
    else:
        request = empty_request(shards, channel.world_size, channel.device)
    serve = exchange_ids(request, shards, channel, problem, final)
    return None if serve is None else Routes(request, serve)
