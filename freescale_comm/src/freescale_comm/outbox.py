"""Outboxes: each collective's header messages between the ranks of a group on one host.

Every rank owns one ``/dev/shm`` segment per group that the group's other ranks on its host map: a
control block and two boxes. Collective number ``seq`` (counted per group, in call order, the
same on every rank) writes this rank's header message for every peer into box ``seq % 2`` — a
table of (offset, length) per peer, then the bytes; identical messages (an AllGather's piece
for every peer) are written once — and publishes ``posted = seq``. A peer reads its message
there, in place, as soon as it sees that counter, and says it is done with every box up to
``seq`` by its own ``consumed`` counter; a box is written again (collective ``seq + 2``) only
once every peer has consumed ``seq``. One copy in, one copy out and two counters per
collective, instead of a ring message per peer in each direction. Where a header names pieces
that its peer reads from the sender's memory (``named_reads``), the peer consumes it only once
they are read, which is how the sender learns it (``reads_done``).

A rank that has to wait for its peers' ``consumed`` raises a flag in its control block, so that
the peers send it a wake-up byte (``shm.Channel.wake_peer``) only then; ``posted`` wakes every
sleeping peer, who all wait for it. ``Hub.sleeping`` re-reads the counters after a thread says
it sleeps (``moved``), the same handshake the rings use. The ordering rests on x86-64's TSO, as
the rings' does (``shm.rings_supported``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from freescale_comm import shm
from freescale_comm.errors import FreescaleError
from freescale_comm.liveness import Departure

# u64 words, one cache line apart: posted, consumed, "wake me when you consume" (raised while
# a write waits for a box), "left the group having finished N collectives" as N + 1
# (``mark_left``), "wake me when you consume" for good (raised once a collective waited for
# its peers' reads of its pieces, ``reads_done``: several threads may wait for them at once, so
# none lowers it), the collectives the leaver ran on Gloo (written before the left word), and
# "aborted the group" as the length of the reason + 1, its UTF-8 bytes from ``_REASON_AT``
# (``mark_aborted``).
_CTRL_BYTES = 4096
_POSTED, _CONSUMED, _WANTS_CONSUMED, _LEFT, _WANTS_READS_DONE, _LEFT_GLOO = 0, 8, 16, 24, 32, 40
_ABORTED = 48
_REASON_AT = 1024
_ALIGN = 64


def _round_up(value: int, to: int) -> int:
    return -(-value // to) * to


class Box:
    """One box of a segment: the per-peer table and the message bytes."""

    def __init__(self, base: np.ndarray, offset: int, size: int, world_size: int) -> None:
        table_bytes = _round_up(16 * world_size, _ALIGN)
        # The table as u64 words, (offset, length) per peer, and the bytes also as a
        # memoryview: a store or a slice through one costs a third to a half of numpy's, which
        # counts on every small collective.
        self.words = memoryview(base[offset : offset + 16 * world_size]).cast("Q")
        self.data = base[offset + table_bytes : offset + size]
        self.bytes = memoryview(self.data)


class Segment:
    """A rank's outbox segment, created (its owner) or mapped (its peers)."""

    def __init__(self, path: str, size: int, create: bool) -> None:
        self._map, _ = shm.map_segment(path, size, create)
        self.path = path
        self.base = np.frombuffer(self._map, dtype=np.uint8)
        self.ctrl = memoryview(self._map)[:_CTRL_BYTES].cast("Q")  # u64 words, ints

    def boxes(self, box_size: int, world_size: int) -> list[Box]:
        return [Box(self.base, _CTRL_BYTES + k * box_size, box_size, world_size) for k in (0, 1)]

    def close(self) -> None:
        self.base = self.ctrl = None
        with contextlib.suppress(BufferError):  # a view still held elsewhere: unmapped at exit
            self._map.close()


class Outboxes:
    """This rank's box pair and its view of those of its group's peers on this host.

    Args:
        hub: the process's rings (wake-up bytes; it re-reads the counters before a sleep).
        links: the ring link to every peer (the sleep flags and wake-up sockets live there).
        rank: this rank in the group.
        world_size: ranks in the group (each box has a table entry per rank).
        own: this rank's segment; ``peers``: those of the peers on this host, mapped.
        box_bytes: room for messages in one box.
    """

    def __init__(
        self,
        hub: shm.Hub,
        links: dict[int, shm.Link],
        rank: int,
        world_size: int,
        own: Segment,
        peers: dict[int, Segment],
        box_bytes: int,
    ) -> None:
        self.hub = hub
        self.rank = rank
        self._links = links
        self._own = own
        self._peers = peers
        box_size = self.box_size(world_size, box_bytes)
        self._boxes = own.boxes(box_size, world_size)
        self._peer_boxes = {p: s.boxes(box_size, world_size) for p, s in peers.items()}
        self._posted = 0  # the last seq this rank published
        self._consumed = 0  # ... and consumed (every box up to it read)
        self._done: set[int] = set()  # seqs read, beyond the contiguous ``_consumed``
        self._seen = {p: (0, 0) for p in peers}  # the peers' counters at the last ``moved``

    def reaches(self, peer: int) -> bool:
        return peer in self._peers

    @property
    def posted(self) -> int:
        """How many collectives this rank has published (tests check the path)."""
        return self._posted

    @staticmethod
    def box_size(world_size: int, box_bytes: int) -> int:
        return _round_up(_round_up(16 * world_size, _ALIGN) + box_bytes, 4096)

    @staticmethod
    def segment_bytes(world_size: int, box_bytes: int) -> int:
        return _CTRL_BYTES + 2 * Outboxes.box_size(world_size, box_bytes)

    # ------------------------------------------------------------------- writing (in seq order)
    def writable(self, seq: int) -> bool:
        """Whether box ``seq % 2`` may take collective ``seq``'s messages now: the previous
        collective is published and every peer has read this box's last contents."""
        if self._posted != seq - 1:
            return False
        if self._box_read(seq - 2):
            self._own.ctrl[_WANTS_CONSUMED] = 0
            return True
        self._own.ctrl[_WANTS_CONSUMED] = 1  # the peers wake this rank when they consume
        # Read again after the flag's store: a peer that consumed after the first read may
        # have read the flag before it was raised, and sent no wake-up (it stores its counter,
        # fences, then reads the flag: one of the two sides sees the other).
        shm.full_fence()
        if self._box_read(seq - 2):
            self._own.ctrl[_WANTS_CONSUMED] = 0
            return True
        return False

    def _box_read(self, seq: int) -> bool:
        """Whether every peer has consumed collective ``seq`` (its box may be written)."""
        return all(s.ctrl[_CONSUMED] >= seq for s in self._peers.values())

    def reads_done(self, seq: int, readers: Sequence[int]) -> bool:
        """Whether each of ``readers`` has consumed collective ``seq``: a peer that reads
        pieces named in this rank's header consumes it only once it has read them
        (``named_reads``)."""
        peers = self._peers
        if all(peers[p].ctrl[_CONSUMED] >= seq for p in readers):
            return True
        if not self._own.ctrl[_WANTS_READS_DONE]:
            self._own.ctrl[_WANTS_READS_DONE] = 1
            # Read again after the flag's store, as ``writable`` does.
            shm.full_fence()
            return all(peers[p].ctrl[_CONSUMED] >= seq for p in readers)
        return False

    def write(self, seq: int, messages: Sequence[tuple[int, Sequence[np.ndarray]]]) -> None:
        """Writes (peer, message parts) into box ``seq % 2`` and publishes it (``writable``
        must hold). A message made of the same buffer objects as an earlier one (a plan hands
        every peer of an AllGather one view of its input) is written once."""
        box = self._boxes[seq & 1]
        data, words = box.bytes, box.words
        room = len(data)
        cursor = 0
        written: dict[tuple[int, ...], tuple[int, int]] = {}
        for peer, parts in messages:
            key = tuple(map(id, parts))  # the parts are alive: no id is reused meanwhile
            span = written.get(key)
            if span is None:
                start = cursor
                for part in parts:
                    end = cursor + len(part)
                    if end > room:
                        raise FreescaleError(
                            f"outbox: {end} bytes of headers exceed the box's {room}"
                        )
                    data[cursor:end] = part
                    cursor = end
                span = written[key] = (start, cursor - start)
                cursor = _round_up(cursor, _ALIGN)
            words[2 * peer], words[2 * peer + 1] = span
        self._own.ctrl[_POSTED] = seq  # after the bytes and the table (TSO keeps the order)
        # Only then may the next collective's write start (``writable``), perhaps on another
        # thread: its counter must never be overwritten by this one's.
        self._posted = seq
        self._wake(lambda segment: True)

    # ------------------------------------------------------------------- reading
    def arrived(self, peer: int, seq: int) -> bool:
        return self._peers[peer].ctrl[_POSTED] >= seq

    def read(self, peer: int, seq: int) -> np.ndarray:
        """``peer``'s message to this rank in collective ``seq`` (``arrived``): a view of its
        box, valid until this rank ``release``-s ``seq``."""
        box = self._peer_boxes[peer][seq & 1]
        words, rank = box.words, self.rank
        start, length = words[2 * rank], words[2 * rank + 1]
        if start + length > len(box.data):
            raise FreescaleError(f"rank {peer}'s outbox names bytes outside its box")
        return box.data[start : start + length]

    def release(self, seq: int) -> None:
        """This rank is done with every peer's box of collective ``seq`` (each collective
        releases once; the counter the peers see moves over the contiguous ones)."""
        with self.hub.lock:  # collectives finish on several threads
            if seq <= self._consumed or seq in self._done:
                return
            self._done.add(seq)
            moved = False
            while self._consumed + 1 in self._done:
                self._consumed += 1
                self._done.remove(self._consumed)
                moved = True
            if moved:
                self._own.ctrl[_CONSUMED] = self._consumed
                self._wake_locked(_waits_for_consumed)

    # ------------------------------------------------------------------- sleeping and waking
    def moved(self) -> bool:
        """Whether a peer's counters changed since the last call (``Hub.progress``)."""
        moved = False
        for peer, segment in self._peers.items():
            ctrl = segment.ctrl
            now = (ctrl[_POSTED], ctrl[_CONSUMED])
            if now != self._seen[peer]:
                self._seen[peer] = now
                moved = True
        return moved

    def _wake(self, wants: Callable[[Segment], bool]) -> None:
        with self.hub.lock:
            self._wake_locked(wants)

    def _wake_locked(self, wants: Callable[[Segment], bool]) -> None:
        shm.full_fence()  # the counter's store before the flags' loads
        for peer, segment in self._peers.items():
            if wants(segment):
                self._links[peer].host.wake_peer(fenced=True)

    def mark_left(self, leaving: Departure) -> None:
        """Tells this host's peers that this rank destroys the group, and what it had done
        (``departures``): they read it from their own mapping, also once this process has
        exited and without the store (whose host may be this one)."""
        self._own.ctrl[_LEFT_GLOO] = leaving.gloo_calls
        self._own.ctrl[_LEFT] = leaving.finished + 1  # after the other word (TSO keeps it so)

    def mark_aborted(self, reason: str) -> None:
        """Tells this host's peers that this rank aborted the group and why (``aborts``): a
        peer that finds this process gone before the abort key reaches it (the store may have
        left with this process) names this reason, not the exit."""
        ctrl, base = self._own.ctrl, self._own.base  # None once closed
        if ctrl is None or base is None or ctrl[_ABORTED]:
            return  # closed, or the first reason stays
        data = reason.encode()[: _CTRL_BYTES - _REASON_AT]
        base[_REASON_AT : _REASON_AT + len(data)] = np.frombuffer(data, np.uint8)
        ctrl[_ABORTED] = len(data) + 1  # after the bytes (TSO keeps the order)

    def aborts(self) -> dict[int, str]:
        """The peers of this host that aborted the group (``mark_aborted``): rank -> reason."""
        told = {}
        for peer, segment in self._peers.items():
            ctrl, base = segment.ctrl, segment.base  # None once closed
            if ctrl is not None and base is not None and ctrl[_ABORTED]:
                data = bytes(base[_REASON_AT : _REASON_AT + int(ctrl[_ABORTED]) - 1])
                told[peer] = data.decode(errors="replace")
        return told

    def departures(self) -> dict[int, Departure]:
        """The peers of this host that left the group (``mark_left``), by rank."""
        left = {}
        for peer, segment in self._peers.items():
            ctrl = segment.ctrl  # None once closed
            if ctrl is not None and ctrl[_LEFT]:
                left[peer] = Departure(int(ctrl[_LEFT]) - 1, int(ctrl[_LEFT_GLOO]))
        return left

    def close(self) -> None:
        self._boxes = []
        self._peer_boxes = {}
        for segment in (self._own, *self._peers.values()):
            segment.close()


def _waits_for_consumed(segment: Segment) -> bool:
    """Whether the owner of ``segment`` asked to be woken when a peer consumes."""
    ctrl = segment.ctrl
    return ctrl[_WANTS_CONSUMED] != 0 or ctrl[_WANTS_READS_DONE] != 0


def open_outboxes(
    store: Any,
    hub: shm.Hub,
    links: dict[int, shm.Link],
    rank: int,
    world_size: int,
    host_ranks: list[int],
    box_bytes: int,
    timeout_s: float,
) -> tuple[Outboxes | None, str]:
    """Makes this rank's segment and maps those of the other ``host_ranks`` (the group ranks
    of this host, this one included; each of them calls it) through the group's store. Returns
    the outboxes, or None and why this rank could not make or map one (the group then agrees
    on whether every rank has them)."""
    size = Outboxes.segment_bytes(world_size, box_bytes)
    path = hub.segment_path("box")
    own: Segment | None = None
    problem = ""
    peers: dict[int, Segment] = {}
    try:
        try:
            own = Segment(path, size, create=True)
        except OSError as err:
            problem = f"could not create an outbox in /dev/shm: {err}"
        store.set(f"freescale/box/{rank}", path if own is not None else "")
        # Bounded: a peer that died during set-up fails it within the group timeout.
        wait = timedelta(seconds=timeout_s)
        store.wait([f"freescale/box/{p}" for p in host_ranks if p != rank], wait)
        for peer in host_ranks:
            if peer == rank:
                continue
            theirs = store.get(f"freescale/box/{peer}").decode()
            if not theirs:
                problem = problem or f"rank {peer} could not create its outbox"
                continue
            try:
                peers[peer] = Segment(theirs, size, create=False)
            except (OSError, FreescaleError) as err:
                problem = problem or f"could not map rank {peer}'s outbox: {err}"
        # Every peer has mapped (or given up on) this segment once every rank reports:
        # unlinked then, so that its memory goes with the processes whatever happens to them.
        # A rank that failed reports too: the others wait for every rank here.
        store.set(f"freescale/box_mapped/{rank}", "1")
        store.wait([f"freescale/box_mapped/{p}" for p in host_ranks], wait)
    except BaseException:  # the store failed (or the wait timed out): nothing is kept
        for segment in (own, *peers.values()):
            if segment is not None:
                segment.close()
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if problem or own is None:
        for segment in (own, *peers.values()):
            if segment is not None:
                segment.close()
        return None, problem
    return Outboxes(hub, links, rank, world_size, own, peers, box_bytes), ""
