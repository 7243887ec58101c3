"""Group set-up through the c10d store with a constant number of requests per rank.

Every rank publishes one entry (its host identity and UCX worker address); the first rank of
each block of about sqrt(N) ranks gathers its block's entries into one key, and every rank then
reads the group id and all blocks in one ``multi_get``. A rank makes 3-6 requests whatever the
group size (reading every rank's entry, as before, was N requests' worth of key reads per rank,
N² in all); the store reads N + N·sqrt(N) keys and sends every rank the N entries it needs (its
collectives may talk to any peer).

The keys live under an incarnation prefix: ``init_process_group`` after ``destroy`` gives the new
group the same c10d prefix, and its ranks must not read the addresses, group id or abort key of
the group before it. Every rank adds 1 to a counter of groups of its size under that prefix, so
the ranks of the k-th such group (each earlier one fully set up, hence counted N times) all
compute k.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from freescale_comm.liveness import ABORT_KEY

_LENGTH = struct.Struct("<I")


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


def incarnation_keys(store: Any, size: int) -> Any:
    """The group's own keys: ``store`` under the prefix of this incarnation (module docstring)."""
    incarnation = (store.add(f"freescale/incarnations/{size}", 1) - 1) // size
    return dist.PrefixStore(f"freescale/{size}.{incarnation}", store)


@dataclass(frozen=True)
class Directory:
    """What set-up agreed on: the group id (tag space) and every rank's entry."""

    group_id: int
    entries: list[bytes]


def start(keys: Any, root: Any, rank: int) -> None:
    """Rank 0's part before anyone reads: a group id for the tags (a counter in the root store,
    so that groups never share one) and the empty abort key every liveness poll reads."""
    if rank == 0:
        keys.set(ABORT_KEY, b"")
        keys.set("group_id", str(root.add("freescale/next_group_id", 1)))


def exchange(keys: Any, rank: int, size: int, entry: bytes) -> Directory:
    """Publishes ``entry`` and returns every rank's (module docstring); blocks until all joined.

    Rank 0 must have called ``start`` first (on its own thread: the others wait for it here).
    """
    block = block_size(size)
    keys.set(f"entry/{rank}", entry)
    if rank % block == 0:
        members = range(rank, min(size, rank + block))
        keys.set(f"block/{rank // block}", pack(keys.multi_get([f"entry/{p}" for p in members])))
    blocks = math.ceil(size / block)
    values = keys.multi_get(["group_id"] + [f"block/{b}" for b in range(blocks)])
    entries = [e for raw in values[1:] for e in unpack(bytes(raw))]
    return Directory(int(values[0]), entries)
