"""Signatures that every rank of a collective exchanges before any data moves.

Each rank describes its side of the collective in a fixed-size header: the operation, the dtype,
the device type, how many tensors, how many bytes it will send to and expects from every peer,
how those bytes split into tensors where a message carries several (a coalesced AllGather: the
same total split differently would otherwise be cut at the receiver's boundaries), and any
error its own inputs already have (a split that does not add up, an output of the wrong size).
Every rank receives every header, so every rank holds the same table and reaches the same
verdict: a mismatch fails the collective on all ranks, with the same message, and no data byte
is moved. The header of a 4-rank group is about 400 bytes.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_VERSION = 2
_FIXED_INTS = 6  # version, op, device, count, error flag, send layout
_NAME_BYTES = 24
_MESSAGE_BYTES = 200
DEVICE_CODES = {"cpu": 0, "cuda": 1, "cuda-staged": 2}


def _code(text: str) -> int:
    return zlib.crc32(text.encode())


@dataclass(frozen=True)
class Signature:
    """One rank's side of a collective.

    Attributes:
        op: collective name (e.g. ``"all_to_all_single"``).
        dtype: dtype name, e.g. ``"torch.float32"``.
        device: ``"cpu"``, ``"cuda"`` (direct path) or ``"cuda-staged"``: ranks that move CUDA
            data by different paths disagree on message numbering, so the path is checked too.
        count: number of tensors (coalesced / list variants).
        send_bytes: bytes this rank sends to each group rank (itself included).
        recv_bytes: bytes this rank expects from each group rank.
        error: what is wrong with this rank's own arguments, or "".
        send_layout: where one message to a peer carries several tensors, a digest of their
            sizes (``layout``); 0 where it carries one.
        recv_layouts: per group rank, the digest of the sizes this rank expects in its message
            (empty: all 0).
    """

    op: str
    dtype: str
    device: str
    count: int
    send_bytes: Sequence[int]
    recv_bytes: Sequence[int]
    error: str = ""
    send_layout: int = 0
    recv_layouts: Sequence[int] = ()

    @staticmethod
    def size(world_size: int) -> int:
        """Bytes of an encoded header in a group of ``world_size`` ranks."""
        return 8 * _ints(world_size) + _NAME_BYTES + _MESSAGE_BYTES

    def encode(self, world_size: int) -> np.ndarray:
        """The header as a uint8 array of ``Signature.size(world_size)`` bytes."""
        ints = [
            _VERSION,
            _code(self.op),
            DEVICE_CODES.get(self.device, -1),
            self.count,
            1 if self.error else 0,
            self.send_layout,
        ]
        ints += [int(b) for b in self.send_bytes] + [int(b) for b in self.recv_bytes]
        ints += [int(d) for d in self.recv_layouts] or [0] * world_size
        blob = struct.pack(f"<{len(ints)}q", *ints)
        blob += self.dtype.encode()[:_NAME_BYTES].ljust(_NAME_BYTES, b"\0")
        blob += self.error.encode()[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0")
        return np.frombuffer(bytearray(blob), dtype=np.uint8)

    @staticmethod
    def decode(buffer: np.ndarray, world_size: int, op: str) -> Signature:
        """Inverse of ``encode``; ``op`` names the collective when the code matches it."""
        raw = buffer.tobytes()
        n_ints = _ints(world_size)
        ints = struct.unpack_from(f"<{n_ints}q", raw)
        n, first = world_size, _FIXED_INTS
        text = raw[8 * n_ints :]
        dtype = text[:_NAME_BYTES].rstrip(b"\0").decode(errors="replace")
        error = text[_NAME_BYTES:].rstrip(b"\0").decode(errors="replace")
        if ints[0] != _VERSION:
            error = error or f"speaks header version {ints[0]} (this rank: {_VERSION})"
        devices = {code: name for name, code in DEVICE_CODES.items()}
        return Signature(
            op=op if ints[1] == _code(op) else f"<another collective, code {ints[1]:#x}>",
            dtype=dtype,
            device=devices.get(ints[2], "unknown"),
            count=ints[3],
            send_bytes=ints[first : first + n],
            recv_bytes=ints[first + n : first + 2 * n],
            error=error if ints[4] else "",
            send_layout=ints[5],
            recv_layouts=ints[first + 2 * n :],
        )


def _ints(world_size: int) -> int:
    return _FIXED_INTS + 3 * world_size


def layout(sizes: Sequence[int]) -> int:
    """A digest of the tensor sizes that make up one message (for ``Signature``)."""
    return zlib.crc32(struct.pack(f"<{len(sizes)}q", *sizes)) + 1


def judge(headers: Sequence[np.ndarray], world_size: int, op: str) -> str | None:
    """The verdict on a table of encoded headers (rank order): the first problem, or None.

    The common case, a consistent table, is recognised on the raw headers (integers unpacked,
    the shared fields compared as bytes) without building a ``Signature`` per rank; only a table
    with a problem is decoded to name it.
    """
    n, first = world_size, _FIXED_INTS
    n_ints = _ints(n)
    unpack = struct.Struct(f"<{n_ints}q").unpack_from
    rows = [unpack(h) for h in headers]
    # Version, op, device, count and dtype name must be byte-identical on every rank.
    name = slice(8 * n_ints, 8 * n_ints + _NAME_BYTES)
    shared = {h[:32].tobytes() + h[name].tobytes() for h in headers}
    consistent = len(shared) == 1 and rows[0][0] == _VERSION and not any(r[4] for r in rows)
    if consistent and n <= 16:
        consistent = all(
            rows[s][first + d] == rows[d][first + n + s]
            and rows[s][5] == rows[d][first + 2 * n + s]
            for s in range(n)
            for d in range(n)
        )
    elif consistent:
        raw = b"".join(h[: 8 * n_ints].tobytes() for h in headers)
        table = np.frombuffer(raw, dtype="<i8").reshape(n, n_ints)
        sends, recvs = table[:, first : first + n], table[:, first + n : first + 2 * n]
        layouts = table[:, first + 2 * n :]
        consistent = np.array_equal(sends, recvs.T) and bool(
            (layouts == table[:, 5][None, :]).all()
        )
    if consistent:
        return None
    return verdict([Signature.decode(h, world_size, op) for h in headers])


def verdict(signatures: Sequence[Signature]) -> str | None:
    """Checks the table of every rank's signature; returns the first problem, or None.

    Deterministic in the table alone, so every rank that holds the same table gets the same
    answer.
    """
    for rank, sig in enumerate(signatures):
        if sig.error:
            return f"rank {rank}: {sig.error}"
    for field, what in (("op", "calls"), ("dtype", "has dtype"), ("device", "has device")):
        values = [getattr(sig, field) for sig in signatures]
        if len(set(values)) > 1:
            listed = ", ".join(f"rank {r} {what} {v}" for r, v in enumerate(values))
            return f"ranks disagree: {listed}"
    counts = [sig.count for sig in signatures]
    if len(set(counts)) > 1:
        return f"ranks pass different numbers of tensors: {counts}"
    for src, sig in enumerate(signatures):
        for dst, sent in enumerate(sig.send_bytes):
            expected = signatures[dst].recv_bytes[src]
            if sent != expected:
                return (
                    f"rank {src} sends {sent} bytes to rank {dst}, which expects {expected} "
                    "(sizes or split sizes disagree across ranks)"
                )
    for src, sig in enumerate(signatures):
        for dst, other in enumerate(signatures):
            expected = other.recv_layouts[src] if other.recv_layouts else 0
            if sig.send_layout != expected:
                return (
                    f"rank {src} sends rank {dst} the same bytes split into tensors of other "
                    "sizes than it expects (the inputs' sizes differ across ranks)"
                )
    return None
