"""Group set-up through the c10d store: a constant number of requests per rank, addresses on use.

Every rank publishes one entry (its host identity and UCX worker address) and appends its rank
(with its process's identity, which liveness watches) to its host's list; the first rank of each
block of about sqrt(N) ranks gathers its block's entries into one key. Once every block exists
(one ``wait``), a rank reads the group id and its host's list (one ``multi_get``): that is all
set-up needs (the shared-memory rings are between ranks of one host). A peer's address is read
only when this rank first talks to it over UCX, a block at a time, so a rank reads what its
collectives need: two blocks for a ring, all of them for an AllToAll. Set-up makes 9 requests
per rank (12 for a block's first rank; 4 of them learn the incarnation, below) whatever N, rank
0 also polling for the incarnation's confirmations, and the store reads O(N) keys and bytes in all
(every rank reading every rank's address and host at creation would be 2·N² key reads, N²·280
bytes: 290 MB at 1,024 ranks).

The keys live under an incarnation prefix: ``init_process_group`` after ``destroy``, and every
restart of torchrun's workers, give the new group the same c10d prefix in the same store, and its
ranks must not read the addresses, group id or abort key of a group before it. Rank 0 draws the
incarnation at random and hands it to each rank that asks with a nonce of its own
(``incarnation_keys``): an answer to another nonce is not this rank's, and a request rank 0 read
before a rank made its own is answered again until every rank has confirmed. A counter of
joins (the scheme before) desynchronised for good once one rank of an attempt died before
joining.
"""

from __future__ import annotations

import math
import re
import secrets
import struct
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from freescale_comm import liveness
from freescale_comm.errors import FreescaleError

_LENGTH = struct.Struct("<I")
# What ranks exchange after set-up (headers, outboxes, the rings' control blocks, IPC flags):
# raised whenever it changes, so that a group whose ranks run versions that cannot talk to
# each other fails its set-up on every rank (``setup_agreement``) instead of hanging.
WIRE_VERSION = 3


def setup_agreement(shared_options: str, invalid_options: str | None = None) -> str:
    """What every rank's set-up must find equal to rank 0's: the wire version and the options
    every rank must share (``FreescaleOptions.shared``), and, where this rank refused its own
    options, why (no rank's set-up may then succeed: it cannot agree with them all)."""
    refused = "" if invalid_options is None else f", invalid_options={invalid_options!r}"
    return f"wire_version={WIRE_VERSION}, {shared_options}{refused}"


def agreement_differences(agreements: list[str], shown: int = 4) -> str:
    """Which ranks' ``setup_agreement`` differs from rank 0's (``agreements[0]``), and in which
    fields: "rank 1 has eager_bytes=16 where rank 0 has 65536; ..." (the first ``shown`` such
    ranks)."""
    first = _agreement_fields(agreements[0])
    notes = []
    for rank, text in enumerate(agreements):
        fields = _agreement_fields(text)
        changed = [name for name in {**first, **fields} if fields.get(name) != first.get(name)]
        if changed:
            notes.append(
                f"rank {rank} has "
                + ", ".join(f"{name}={fields.get(name, 'none')}" for name in changed)
                + " where rank 0 has "
                + ", ".join(f"{first.get(name, 'none')}" for name in changed)
            )
    more = len(notes) - shown
    return "; ".join(notes[:shown]) + (f"; and {more} more ranks" if more > 0 else "")


def _agreement_fields(text: str) -> dict[str, str]:
    """``setup_agreement``'s text as name -> value text (a refusal, last, is free text)."""
    head, refused, why = text.partition(", invalid_options=")
    fields = dict(re.findall(r"(\w+)=(.*?)(?=, \w+=|$)", head))
    if refused:
        fields["invalid_options"] = why
    return fields


def block_size(size: int) -> int:
    """Ranks per gathering block: about sqrt(N), so that leaders and readers stay balanced."""
    return max(1, math.isqrt(max(0, size - 1)) + 1)


def pack(fields: list[bytes]) -> bytes:
    """Length-prefixed concatenation of ``fields``."""
    return b"".join(_LENGTH.pack(len(f)) + f for f in fields)


def unpack(blob: bytes) -> list[bytes]:
    """Inverse of ``pack``."""
    fields, offset = [], 0
    view = memoryview(blob)
    while offset < len(blob):
        (length,) = _LENGTH.unpack_from(blob, offset)
        offset += _LENGTH.size
        fields.append(bytes(view[offset : offset + length]))
        offset += length
    return fields


def incarnation_keys(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """The group's own keys: ``store`` under the prefix of this incarnation, which rank 0 draws
    and every rank learns within ``timeout`` (module docstring); raises ``FreescaleError``
    naming the ranks that never asked, or rank 0 where it never answered."""
    if size == 1:
        return dist.PrefixStore(f"freescale/{size}.{secrets.token_hex(8)}", store)
    asks = [f"freescale/incarnation/{size}/ask/{r}" for r in range(1, size)]
    if rank != 0:
        nonce = secrets.token_hex(8)
        store.set(asks[rank - 1], nonce)
        answer = f"freescale/incarnation/{size}/answer/{rank}/{nonce}"
        try:
            store.wait([answer], timeout)
        except Exception as err:  # torch's DistStoreError: its own timeout text
            raise FreescaleError(
                f"rank {rank}: no answer from rank 0 within {timeout.total_seconds():g} s: it "
                f"did not create the group, or another rank did not join"
            ) from err
        incarnation = bytes(store.get(answer)).decode()
        keys = dist.PrefixStore(f"freescale/{size}.{incarnation}", store)
        if keys.add("confirmed", 1) == size - 1:
            keys.set("all_confirmed", "1")
        return keys
    incarnation = secrets.token_hex(8)
    keys = dist.PrefixStore(f"freescale/{size}.{incarnation}", store)
    deadline = time.monotonic() + timeout.total_seconds()
    try:
        store.wait(asks, timeout)
    except Exception as err:  # torch's DistStoreError: its own timeout text
        missing = [r for r, key in enumerate(asks, 1) if not store.check([key])]
        raise FreescaleError(
            f"rank 0: rank(s) {missing} did not join the group within {timeout.total_seconds():g} s"
        ) from err
    answered: list[bytes | None] = [None] * len(asks)
    pause_s = 0.001
    while True:
        # A request may be a dead attempt's, read before this attempt's rank made its own:
        # each round answers those that changed since the last, until all are confirmed.
        # Polled: a store wait that times out makes torch reconnect (a name lookup).
        nonces = [bytes(n) for n in store.multi_get(asks)]
        fresh = [(r, n) for r, n in enumerate(nonces, 1) if n != answered[r - 1]]
        if fresh:
            store.multi_set(
                [f"freescale/incarnation/{size}/answer/{r}/{n.decode()}" for r, n in fresh],
                [incarnation] * len(fresh),
            )
            for r, nonce in fresh:
                answered[r - 1] = nonce
        time.sleep(pause_s)
        if keys.check(["all_confirmed"]):
            return keys
        if time.monotonic() >= deadline:
            confirmed = int(keys.add("confirmed", 0))
            raise FreescaleError(
                f"rank 0: {size - 1 - confirmed} rank(s) did not join the group within "
                f"{timeout.total_seconds():g} s"
            )
        pause_s = min(0.1, pause_s * 2)


def start(keys: Any, root: Any, rank: int, agreement: str) -> None:
    """Rank 0's part before anyone reads: a group id for the tags (a counter in the root store,
    so that groups never share one), the keys every liveness poll reads
    (``liveness.create_keys``), and what every rank must agree with (``setup_agreement``)."""
    if rank == 0:
        liveness.create_keys(keys)
        keys.set("shared_options", agreement)
        keys.set("group_id", str(root.add("freescale/next_group_id", 1)))


class Directory:
    """The group id, this rank's same-host peers, and every rank's host and address on demand.

    Construction is the set-up exchange (module docstring); it blocks until every rank joined.
    Rank 0 must have called ``start`` first (the others wait for it here).

    Args:
        keys: the group's incarnation keys (``incarnation_keys``).
        rank: this rank.
        size: ranks in the group.
        host: this process's host identity.
        address: this process's UCX worker address.
        timeout: bound on the wait for every rank (a rank that died before joining).
        process: this process's identity for the ranks of its host (``host_processes``).
        lookups: the keys the addresses are read from on use (by default ``keys``): a
            connection of the group's own (``liveness.own_connection``) never waits behind a
            request another thread of the process blocks in.
    """

    def __init__(
        self,
        keys: Any,
        rank: int,
        size: int,
        host: str,
        address: bytes,
        timeout: timedelta,
        process: str = "",
        lookups: Any = None,
    ) -> None:
        self._lookups = keys if lookups is None else lookups
        self.rank, self.size, self.host = rank, size, host
        self._block = block_size(size)
        self._entries: dict[int, tuple[str, bytes]] = {rank: (host, address)}
        self._lock = threading.Lock()
        self.blocks_read = 0
        host_key = f"host/{host}"
        keys.append(host_key, f"{rank}={process},")
        keys.set(f"entry/{rank}", pack([host.encode(), address]))
        if rank % self._block == 0:
            entries = [f"entry/{p}" for p in range(rank, min(size, rank + self._block))]
            keys.wait(entries, timeout)
            keys.set(self._block_key(rank), pack(keys.multi_get(entries)))
        # Every block exists once every rank has appended its host and published its entry.
        blocks = [self._block_key(b * self._block) for b in range(math.ceil(size / self._block))]
        keys.wait(blocks, timeout)
        group_id, local, shared = keys.multi_get(["group_id", host_key, "shared_options"])
        self.group_id = int(group_id)
        self.first_rank_agreement = bytes(shared).decode()  # rank 0's ``start``
        # rank -> its process (``liveness.process_identity``), for the ranks of this host.
        self.host_processes = dict(
            (int(r), identity)
            for r, _, identity in (e.partition("=") for e in bytes(local).decode().split(",") if e)
        )
        self.same_host = sorted(self.host_processes)

    def _block_key(self, rank: int) -> str:
        return f"block/{rank // self._block}"

    def entry(self, peer: int) -> tuple[str, bytes]:
        """``peer``'s host identity and UCX address (its block read from the store first use)."""
        found = self._entries.get(peer)
        if found is None:
            raw = self._lookups.get(self._block_key(peer))
            first = peer - peer % self._block
            fields = [unpack(e) for e in unpack(bytes(raw))]
            with self._lock:
                self.blocks_read += 1
                for offset, (host, address) in enumerate(fields):
                    self._entries[first + offset] = (host.decode(), address)
            found = self._entries[peer]
        return found

    def address(self, peer: int) -> bytes:
        return self.entry(peer)[1]

    def host_of(self, peer: int) -> str:
        """``peer``'s host identity (no store request for this host's ranks)."""
        if peer in self.same_host:
            return self.host
        return self.entry(peer)[0]
