"""Signatures that every rank of a collective exchanges before any data moves.

Each rank describes its side of the collective: the operation, the dtype, the device type, how
many tensors, how many bytes it will send to and expects from every peer, how those bytes split
into tensors where a message carries several (a coalesced AllGather: the same total split
differently would otherwise be cut at the receiver's boundaries), and any error its own inputs
already have (a split that does not add up, an output of the wrong size).

The header every rank sends every peer has a fixed size (280 bytes) whatever the group's: the
shared fields, the error, and two digests of the rank's part of the size table, one over what it
sends (sender, receiver, bytes, layout), one over what it expects. Each pair's entry enters the
sender's send digest and the receiver's receive digest by the same function, so the table is
consistent exactly when the sums of all ranks' send and receive digests agree (up to a 2^-64
chance). Every rank receives every header, so every rank reaches the same verdict from the same
N x 280 bytes; a mismatch fails the collective on all ranks, with the same message, and no data
byte is moved. Only after the digests disagree does a second round exchange the whole table
(``encode_table``: 24 bytes per rank of the group, per header) so that every rank names the
first disagreeing pair the same way (``judge_table``). The full table in every header would make
each collective send N² x 24 bytes per rank (25 MB at 1,024 ranks) and judge N² entries.
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_VERSION = 3  # the fixed-size header
_TABLE_VERSION = 2  # the whole-table encoding (``encode_table``)
_FIXED_INTS = 6  # version, op, device, count, error flag, send layout
_HEADER_INTS = 7  # version, op, device, count, error flag, send digest, receive digest
DTYPE_NAME_BYTES = 24
_MESSAGE_BYTES = 200
# Ends an error text the header cut at ``_MESSAGE_BYTES`` (the rank's own raise has it whole).
_CUT_MARK = " [...] (cut; the whole message is in that rank's own error)"
DEVICE_CODES = {
    "cpu": 0,
    "cuda": 1,
    "cuda-staged": 2,
    "cuda-ipc+direct": 4,
    "cuda-ipc+staged": 5,
}


def _code(text: str) -> int:
    return zlib.crc32(text.encode())


# Every collective the backend runs itself, by header code: each rank names a peer's collective
# from this one table, so a mismatch of collectives reads the same on every rank.
_GATHERS = (
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
)
OPS = (*_GATHERS, *(f"{name} (ring)" for name in _GATHERS), "all_to_all", "all_to_all_single")
_OP_NAMES = {_code(name): name for name in OPS}


@dataclass(frozen=True)
class Signature:
    """One rank's side of a collective.

    Attributes:
        op: collective name (e.g. ``"all_to_all_single"``).
        dtype: dtype name, e.g. ``"torch.float32"``; a coalesced AllGather whose inputs mix
            dtypes names them in order (``"int64+float16"``), or a digest of that list
            (``"mixed <16 hex digits>"``) where it does not fit the field.
        device: ``"cpu"``, ``"cuda"`` (direct path), ``"cuda-staged"`` or
            ``"cuda-ipc+direct"`` / ``"cuda-ipc+staged"`` (IPC with the peers it reaches, that
            path with the others): ranks that move CUDA data by different paths disagree on
            message numbering, so the path is checked too.
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
        """Bytes of an encoded header (``encode``): the same in a group of any size."""
        del world_size
        return 8 * _HEADER_INTS + DTYPE_NAME_BYTES + _MESSAGE_BYTES

    def encode(self, world_size: int) -> np.ndarray:
        """The fixed-size header (module docstring) as a uint8 array of ``Signature.size``."""
        sends, recvs = self.digests(world_size)
        ints = [_VERSION, *self._shared_ints()[1:], sends, recvs]
        return self._with_text(struct.pack(f"<{_HEADER_INTS}q", *ints))

    def digests(self, world_size: int) -> tuple[int, int]:
        """This rank's send and receive digests of the size table, as signed 64-bit ints.

        send = sum over receivers d of f(d)·g(bytes, layout); receive = sum over senders s of
        k(s)·g(bytes, layout) (mod 2^64). Neither needs this rank's own index: ``judge``
        weighs each rank's send digest by k(rank) and its receive digest by f(rank), so both
        totals are the sum over every (sender, receiver) entry of k·f·g, the same when every
        entry agrees; f and k are odd, so one entry that differs changes the difference by an
        odd multiple of a hash difference (never 0 mod 2^64 unless g collides).
        """
        if world_size < _NUMPY_FROM_RANKS:
            return _digests_small(
                self.send_bytes, self.recv_bytes, self.send_layout, self.recv_layouts, world_size
            )
        weights_k, weights_f = _weights(world_size)
        send_layouts = np.full(world_size, self.send_layout & _MASK, dtype=np.uint64)
        recv_layouts = (
            np.array([int(d) & _MASK for d in self.recv_layouts], dtype=np.uint64)
            if self.recv_layouts
            else np.zeros(world_size, dtype=np.uint64)
        )
        sends = weights_f * _entry_hash(_as_u64(self.send_bytes), send_layouts)
        recvs = weights_k * _entry_hash(_as_u64(self.recv_bytes), recv_layouts)
        return _signed(int(sends.sum(dtype=np.uint64))), _signed(int(recvs.sum(dtype=np.uint64)))

    def _shared_ints(self) -> list[int]:
        return [
            _TABLE_VERSION,
            _code(self.op),
            DEVICE_CODES.get(self.device, -1),
            self.count,
            # 1: an error; 2: one whose text the header cuts (``_MESSAGE_BYTES``)
            (2 if len(self.error.encode()) > _MESSAGE_BYTES else 1) if self.error else 0,
        ]

    def _with_text(self, blob: bytes) -> np.ndarray:
        blob += self.dtype.encode()[:DTYPE_NAME_BYTES].ljust(DTYPE_NAME_BYTES, b"\0")
        blob += self.error.encode()[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0")
        return np.frombuffer(bytearray(blob), dtype=np.uint8)

    @staticmethod
    def table_size(world_size: int) -> int:
        """Bytes of an ``encode_table`` header in a group of ``world_size`` ranks."""
        return 8 * _ints(world_size) + DTYPE_NAME_BYTES + _MESSAGE_BYTES

    def encode_table(self, world_size: int) -> np.ndarray:
        """The header with this rank's whole row of the size table (the diagnosis round)."""
        ints = [*self._shared_ints(), self.send_layout]
        ints += [int(b) for b in self.send_bytes] + [int(b) for b in self.recv_bytes]
        ints += [int(d) for d in self.recv_layouts] or [0] * world_size
        return self._with_text(struct.pack(f"<{len(ints)}q", *ints))

    @staticmethod
    def decode(buffer: np.ndarray, world_size: int) -> Signature:
        """The shared fields and the error of a fixed-size header (no sizes: it holds digests)."""
        del world_size
        raw = buffer.tobytes()
        ints = struct.unpack_from(f"<{_HEADER_INTS}q", raw)
        return Signature._decoded(raw, ints, 8 * _HEADER_INTS, _VERSION, (), (), 0, ())

    @staticmethod
    def decode_table(buffer: np.ndarray, world_size: int) -> Signature:
        """Inverse of ``encode_table``."""
        raw = buffer.tobytes()
        n_ints = _ints(world_size)
        ints = struct.unpack_from(f"<{n_ints}q", raw)
        n, first = world_size, _FIXED_INTS
        return Signature._decoded(
            raw,
            ints,
            8 * n_ints,
            _TABLE_VERSION,
            ints[first : first + n],
            ints[first + n : first + 2 * n],
            ints[5],
            ints[first + 2 * n :],
        )

    @staticmethod
    def _decoded(
        raw: bytes,
        ints: Sequence[int],
        text_at: int,
        version: int,
        send_bytes: Sequence[int],
        recv_bytes: Sequence[int],
        send_layout: int,
        recv_layouts: Sequence[int],
    ) -> Signature:
        text = raw[text_at:]
        dtype = text[:DTYPE_NAME_BYTES].rstrip(b"\0").decode(errors="replace")
        error = text[DTYPE_NAME_BYTES:].rstrip(b"\0").decode(errors="replace")
        if ints[4] == 2:
            error += _CUT_MARK
        if ints[0] != version:
            error = error or f"speaks header version {ints[0]} (this rank: {version})"
        devices = {code: name for name, code in DEVICE_CODES.items()}
        return Signature(
            op=_OP_NAMES.get(ints[1], f"<unknown collective, code {ints[1]:#x}>"),
            dtype=dtype,
            device=devices.get(ints[2], "unknown"),
            count=ints[3],
            send_bytes=send_bytes,
            recv_bytes=recv_bytes,
            error=error if ints[4] or ints[0] != version else "",
            send_layout=send_layout,
            recv_layouts=recv_layouts,
        )


def with_own_error(problem: str, rank: int, own_error: str) -> str:
    """``problem`` as this rank raises it: where it is this rank's own error (``verdict``'s
    "rank r: error"), cut by the header, the whole text."""
    own_and_cut = problem.startswith(f"rank {rank}: ") and problem.endswith(_CUT_MARK)
    return f"rank {rank}: {own_error}" if own_and_cut and own_error else problem


def _spans(ranks: list[int]) -> str:
    """Sorted ranks as "0-3, 7, 9-12"."""
    spans, start = [], ranks[0]
    for prev, rank in itertools.pairwise([*ranks, None]):
        if rank is None or rank != prev + 1:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = rank
    return ", ".join(spans)


def _ints(world_size: int) -> int:
    return _FIXED_INTS + 3 * world_size


_MASK = (1 << 64) - 1


def _as_u64(values: Sequence[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).astype(np.uint64)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, element-wise (uint64 arithmetic wraps)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


_WEIGHTS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _weights(world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The odd per-rank weights k (as sender) and f (as receiver) of the digests."""
    weights = _WEIGHTS.get(world_size)
    if weights is None:
        ranks = np.arange(world_size, dtype=np.uint64)
        one = np.uint64(1)
        weights = _WEIGHTS[world_size] = (
            _mix(ranks ^ np.uint64(0x243F6A8885A308D3)) | one,
            _mix(ranks ^ np.uint64(0x13198A2E03707344)) | one,
        )
    return weights


_ENTRY_SALT = 0xA4093822299F31D0


def _entry_hash(nbytes: np.ndarray, layouts: np.ndarray) -> np.ndarray:
    return _mix(_mix(nbytes ^ np.uint64(_ENTRY_SALT)) + layouts)


# Groups of fewer ranks compute the digests and the verdict's sums on Python ints, the same
# values mod 2^64: numpy's cost per call on arrays of a few elements was most of a small
# collective's validation (the digests of 2 ranks: 24 us against 4).
_NUMPY_FROM_RANKS = 12


def _mix_int(x: int) -> int:
    """``_mix`` of one value in [0, 2^64)."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _entry_hash_int(nbytes: int, layout: int) -> int:
    """``_entry_hash`` of one entry (``layout`` in [0, 2^64))."""
    return _mix_int((_mix_int((int(nbytes) & _MASK) ^ _ENTRY_SALT) + layout) & _MASK)


_WEIGHT_INTS: dict[int, tuple[list[int], list[int]]] = {}


def _weight_ints(world_size: int) -> tuple[list[int], list[int]]:
    """``_weights`` as Python ints."""
    weights = _WEIGHT_INTS.get(world_size)
    if weights is None:
        k, f = _weights(world_size)
        weights = _WEIGHT_INTS[world_size] = ([int(v) for v in k], [int(v) for v in f])
    return weights


def _digests_small(
    send_bytes: Sequence[int],
    recv_bytes: Sequence[int],
    send_layout: int,
    recv_layouts: Sequence[int],
    world_size: int,
) -> tuple[int, int]:
    """``Signature.digests`` on Python ints (for groups under ``_NUMPY_FROM_RANKS`` ranks)."""
    weights_k, weights_f = _weight_ints(world_size)
    # One value for every rank, as numpy broadcasts it.
    send_bytes = list(send_bytes) * world_size if len(send_bytes) == 1 else send_bytes
    recv_bytes = list(recv_bytes) * world_size if len(recv_bytes) == 1 else recv_bytes
    layouts = [int(d) & _MASK for d in recv_layouts] if recv_layouts else [0]
    layouts = layouts * world_size if len(layouts) == 1 else layouts
    send_layout &= _MASK
    sends = sum(
        f * _entry_hash_int(b, send_layout) for f, b in zip(weights_f, send_bytes, strict=True)
    )
    recvs = sum(
        k * _entry_hash_int(b, d) for k, b, d in zip(weights_k, recv_bytes, layouts, strict=True)
    )
    return _signed(sends & _MASK), _signed(recvs & _MASK)


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def layout(sizes: Sequence[int]) -> int:
    """A digest of the tensor sizes that make up one message (for ``Signature``)."""
    return zlib.crc32(struct.pack(f"<{len(sizes)}q", *sizes)) + 1


class _NeedsTable:
    """``judge``'s answer when the digests disagree: the whole table must be exchanged to say
    where (``encode_table``, ``judge_table``)."""

    def __repr__(self) -> str:
        return "NEEDS_TABLE"


NEEDS_TABLE = _NeedsTable()
_IPC_DEVICE_CODES = frozenset(
    code for name, code in DEVICE_CODES.items() if name.startswith("cuda-ipc")
)


def names_ipc(header: np.ndarray) -> bool:
    """Whether an encoded header (``Signature.encode``) names the IPC path: the sender's
    message to each peer of its host then carries a CUDA IPC descriptor behind it."""
    at = 8 * 2  # the device code: the third of the header's ints (``encode``)
    return int.from_bytes(header[at : at + 8].tobytes(), "little", signed=True) in _IPC_DEVICE_CODES


def judge(headers: Sequence[np.ndarray], world_size: int) -> str | _NeedsTable | None:
    """The verdict on a table of fixed-size headers (rank order): None (consistent), the first
    problem (an error, or shared fields that differ), or ``NEEDS_TABLE`` (the size digests
    disagree). O(N) in the group size."""
    size = Signature.size(world_size)
    rows = [h[:size].tobytes() for h in headers]
    consistent = (
        _consistent_small(rows, world_size)
        if world_size < _NUMPY_FROM_RANKS
        else _consistent_numpy(rows, world_size)
    )
    if consistent is not None:
        return None if consistent else NEEDS_TABLE
    problem = verdict([Signature.decode(h, world_size) for h in headers])
    return problem if problem is not None else NEEDS_TABLE


# The header's shared fields, byte-identical on every rank of a consistent table: version, op,
# device and count (its first four ints), and the dtype name.
_SHARED_INT_BYTES = 32
_NAMES = slice(8 * _HEADER_INTS, 8 * _HEADER_INTS + DTYPE_NAME_BYTES)


def _consistent_numpy(rows: Sequence[bytes], world_size: int) -> bool | None:
    """``judge``'s common case: whether the digests of headers whose shared fields agree and
    that carry no error agree (None: they do not all qualify)."""
    table = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), -1)
    ints = table[:, : 8 * _HEADER_INTS].view("<i8")
    shared = bool(
        (table[:, :_SHARED_INT_BYTES] == table[0, :_SHARED_INT_BYTES]).all()
        and (table[:, _NAMES] == table[0, _NAMES]).all()
    )
    if not shared or ints[0, 0] != _VERSION or ints[:, 4].any():
        return None
    weights_k, weights_f = _weights(world_size)
    sends = (weights_k * ints[:, 5].astype(np.uint64)).sum(dtype=np.uint64)
    recvs = (weights_f * ints[:, 6].astype(np.uint64)).sum(dtype=np.uint64)
    return bool(sends == recvs)


def _consistent_small(rows: Sequence[bytes], world_size: int) -> bool | None:
    """``_consistent_numpy`` on Python ints."""
    first = rows[0]
    shared = slice(0, _SHARED_INT_BYTES)
    ints = [struct.unpack_from(f"<{_HEADER_INTS}q", row) for row in rows]
    if (
        any(row[shared] != first[shared] or row[_NAMES] != first[_NAMES] for row in rows)
        or ints[0][0] != _VERSION
        or any(row_ints[4] for row_ints in ints)
    ):
        return None
    weights_k, weights_f = _weight_ints(world_size)
    sends = sum(k * (row_ints[5] & _MASK) for k, row_ints in zip(weights_k, ints, strict=True))
    recvs = sum(f * (row_ints[6] & _MASK) for f, row_ints in zip(weights_f, ints, strict=True))
    return (sends - recvs) & _MASK == 0


def judge_table(headers: Sequence[np.ndarray], world_size: int) -> str | None:
    """The verdict on a table of ``encode_table`` headers (rank order): the first problem, or
    None.

    The common case, a consistent table, is recognised on the raw headers (integers unpacked,
    the shared fields compared as bytes) without building a ``Signature`` per rank; only a table
    with a problem is decoded to name it.
    """
    n, first = world_size, _FIXED_INTS
    n_ints = _ints(n)
    unpack = struct.Struct(f"<{n_ints}q").unpack_from
    rows = [unpack(h) for h in headers]
    # Version, op, device, count and dtype name must be byte-identical on every rank.
    name = slice(8 * n_ints, 8 * n_ints + DTYPE_NAME_BYTES)
    shared = {h[:32].tobytes() + h[name].tobytes() for h in headers}
    consistent = len(shared) == 1 and rows[0][0] == _TABLE_VERSION and not any(r[4] for r in rows)
    if consistent:
        raw = b"".join(h[: 8 * n_ints].tobytes() for h in headers)
        table = np.frombuffer(raw, dtype="<i8").reshape(n, n_ints)
        sends, recvs = table[:, first : first + n], table[:, first + n : first + 2 * n]
        layouts = table[:, first + 2 * n :]
        consistent = np.array_equal(sends, recvs.T) and bool(
            (layouts == table[:, 5][None, :]).all()
        )
    if consistent:
        return None
    return verdict([Signature.decode_table(h, world_size) for h in headers])


def verdict(signatures: Sequence[Signature]) -> str | None:
    """Checks the table of every rank's signature; returns the first problem, or None.

    Deterministic in the table alone, so every rank that holds the same table gets the same
    answer.
    """
    for rank, sig in enumerate(signatures):
        if sig.error:
            return f"rank {rank}: {sig.error}"
    for field, one, many in (
        ("op", "calls", "call"),
        ("dtype", "has dtype", "have dtype"),
        ("device", "has device", "have device"),
    ):
        values = [getattr(sig, field) for sig in signatures]
        if len(set(values)) > 1:
            # Ranks grouped by value, in order of first appearance: short in a large group.
            by_value: dict[str, list[int]] = {}
            for rank, value in enumerate(values):
                by_value.setdefault(value, []).append(rank)
            listed = ", ".join(
                f"rank {ranks[0]} {one} {v}"
                if len(ranks) == 1
                else f"ranks {_spans(ranks)} {many} {v}"
                for v, ranks in by_value.items()
            )
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
