"""The CUDA IPC path between ranks of one host: copy-engine copies, ordered on the GPU by flags.

Every rank of a collective tells each peer of its host, in its validation header, where the bytes
meant for that peer lie: a CUDA IPC handle of the allocation and an offset (``Descriptor``). Once
a rank has judged the headers consistent it queues the collective's part between the ranks of its
host on the group's IPC stream (in a group of one host the whole collective, and it returns; the
bytes of peers on other hosts take UCX, ``collective``); no CPU thread waits for the GPU, and the
data moves without a kernel:

1. wait for the caller's stream (the inputs are produced, the outputs free): for a collective
   that pushed (below), a wait for the word its pushes write once done, which they wrote after
   waiting for the caller's stream;
2. per peer, a flag write "my inputs of collective ``seq`` are ready" into the pair's shared
   page (``cuStreamWriteValue64``);
3. the rank's own piece, a local device-to-device copy;
4. per peer, in ring order: wait for its ready flag (``cuStreamWaitValue64``), copy its pieces
   straight from its memory (mapped once per allocation, ``cuIpcOpenMemHandle``) into the
   outputs with ``cudaMemcpyAsync`` (copy engines; over NVLink or PCIe between GPUs), then write
   "I have read yours" into the pair's page;
5. wait for every peer's "I have read yours": only then may the caller reuse its inputs;
6. the end event, which ``work.wait()`` makes the caller's stream wait for (with peers on other
   hosts, an event the collective's last copies wait for).

Flags live in the first page of the pair's host rings (``shm``), page-locked and mapped for the
GPU in both processes: each rank writes only the flags of its outgoing ring and waits only on
those of its incoming one (but for "my pushes are done", which it writes on its push stream
and waits for on its IPC stream), and all only grow (the collective's sequence number, compared
cyclically), so they are never reset. The CPU never writes them, except to release waits when
the group is aborted (by a failed collective, or by the liveness poll that finds a silent peer
or the abort key): a dead peer's flags would otherwise hold the streams forever. A live peer's
GPU may still write a flag of an earlier collective after that, setting it back, so the waits
are released again each second until the streams drain.

Why this does not deadlock although streams wait on flags: each collective's flag writes come
before its waits in one stream, and a rank queues collective ``seq`` once it has every peer's
header of ``seq``, which each peer sends before queueing anything of ``seq`` (and it maps the
peers' memory before queueing any of it); so every wait of ``seq`` is met by GPU work already
queued in the peer, whatever either CPU does next — provided the work each rank queued on its
own streams before the call does not itself wait for that rank's later GPU work. (The flag
written by a CPU thread, which ``cuda``'s module docstring describes, had no such guarantee.)

Collectives are queued in call order (``IpcPath.ready``), so flags grow in stream order. Where a
peer runs on this same GPU (the descriptors name each sender's GPU), the two processes' contexts
time-slice it: a queued wait spins through its context's slice while the peer's context, which
would meet it, cannot run. So there each collective is queued only once the previous one has
finished (measured on one H200 shared by 2 ranks: 4.4 ms per back-to-back 8-byte AllToAll
without this, 1.3 ms with it). There, where the caller's stream has run everything queued
before the call by the verdict, the pulls are also gated on the CPU (``GatedPulls``): steps
1-3 and the pushed pieces are queued after the verdict, each peer's copies and "I have read
yours" only once the CPU sees that peer's ready flag, and the collective ends only once the
CPU sees every reader's "I have read yours" (a thread polls the flags, ``_FlagPoller``). No
wait of step 4 or 5 is queued then, so the pull's GPU never waits for a context that cannot
run; but the collective's end, and so ``wait()``, now waits for the peers on the CPU, which is
why a caller that has queued GPU work keeps the GPU waits and a ``wait()`` that returns at once.
Either choice is local: a gated rank's peers still find every flag they wait for written.

Small sends are pushed instead of pulled. Each rank keeps a mailbox, a device allocation of its own
with ``MAILBOX_SLOTS`` slots of ``MAILBOX_SLOT_BYTES`` per sender, whose handle every descriptor
carries; once a rank has mapped a peer's mailbox, a send to that peer that fits a slot is copied
into it at the call, before any header leaves, on the group's push stream (behind the caller's
stream), followed by a "pushed" flag, provided the CPU sees the receiver's flag that it has read
the slot's previous content; a send to a slot not read yet is pulled instead. (No GPU waits for
that flag: the receiver's GPU work that meets it may sit, in one hardware queue under
``CUDA_DEVICE_MAX_CONNECTIONS=1``, behind its own wait of that kind, and both ranks would hang. A
stream of their own, so that a push is not queued behind the IPC stream's waits for earlier
collectives.) The receiver's queued collective
waits for that flag and copies out of its own mailbox into the output, so the outputs are still
written only after the verdict, but the copy between the processes overlaps the header exchange,
and no GPU waits for another's verdict (a pull waits for the peer's queued "ready" and then the
peer waits for the puller's "read"). A collective that fails its verdict frees the slots pushed
to it unread with a "read" flag write on the IPC stream, queued once every earlier collective is
(``done_with``), so that a pair's flags are written in call order; a "read" flag never goes back.

Memory that CUDA IPC cannot export (``expandable_segments``, virtual memory management) is copied
into a scratch allocation of the group's own first, on the same stream. A peer's allocation is
mapped on its first use (0.13–0.20 ms each on the H200) and kept, up to 64 per peer: a training
loop over the caching allocator's blocks maps them once.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from freescale_comm.algorithms import address
from freescale_comm.cuda import (
    _CLOSE_WAIT_S,
    IpcHandle,
    _destroy_stream,
    _new_stream,
    _register,
    driver,
)
from freescale_comm.errors import FreescaleError
from freescale_comm.stream_ops import StreamOps

if TYPE_CHECKING:
    from freescale_comm.shm import Link

logger = logging.getLogger(__name__)

_ENTRY = struct.Struct("<64sQQ")  # handle, offset in the allocation, bytes
# The sender's GPU (UUID), its mailbox's handle, the receiver's mailbox slot its pieces were
# pushed into (-1: pull them from the handles named), pieces.
_COUNT = struct.Struct("<16s64sqQ")
_NO_HANDLE = bytes(64)
# 64-bit flags: a pair's flag that one kind of collective never writes (pushes write "pushed",
# pulls "ready" and "done") may lag the sequence number by any amount, which 32 bits would
# compare the wrong way after 2^31 collectives.
_CAN_USE_64_BIT_STREAM_MEM_OPS = 122  # CUdevice_attribute (the v2 API's; 93 is v1's)
_LAZY_PEER_ACCESS = 0x1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_FLAG_PAGE = 4096
# uint64 indices in a ring's control block (``shm._CTRL_BYTES``): "inputs ready", "read yours",
# "pushed into your mailbox", and per mailbox slot "read what you pushed there"; and one that
# only the writer's own IPC stream waits for: "my pushes of collective ``seq`` are done" (never
# released by an abort: for a pushing collective it is the IPC stream's wait for the caller's
# stream).
_READY, _DONE, _PUSHED, _CONSUMED = 16, 24, 20, 28
_PUSHES_DONE = 22
MAILBOX_SLOTS = 4
MAILBOX_SLOT_BYTES = 256 << 10
_RELEASE = 1 << 30  # abort: flags set this far ahead let every queued wait pass
_MAPS_PER_PEER = 64
_FLAG_POLL_S = 20e-6  # gated pulls' flags (a sleep takes 50-100 us in practice)


def pieces_in(room: int) -> int:
    """How many pieces a descriptor of at most ``room`` bytes can name."""
    return max(0, (room - _COUNT.size) // _ENTRY.size)


class Piece(NamedTuple):
    """Where a peer's bytes for this rank lie: an allocation (its IPC handle), offset, size;
    pushed pieces lie in this rank's mailbox, at that offset. (Tuples: decoded per peer per
    call, where a frozen dataclass's construction cost microseconds.)"""

    handle: bytes
    offset: int
    nbytes: int


class Descriptor(NamedTuple):
    """What one rank's header tells a peer: the sender's GPU and mailbox, the slot of the
    peer's mailbox its pieces were pushed into (-1: none), and where the pieces lie."""

    gpu: bytes
    mailbox: bytes
    slot: int
    pieces: list[Piece]


def encode(
    gpu: bytes, mailbox: bytes, slot: int, pieces: Sequence[tuple[bytes, int, int]]
) -> np.ndarray:
    """A descriptor: its fixed part, then per piece (handle, offset, bytes) in message order."""
    data = _COUNT.pack(gpu, mailbox, slot, len(pieces)) + b"".join(_ENTRY.pack(*p) for p in pieces)
    return np.frombuffer(data, dtype=np.uint8)


def decode(message: np.ndarray, pieces: int) -> Descriptor:
    """The descriptor at the start of ``message``, which must name ``pieces`` pieces."""
    gpu, mailbox, slot, count = _COUNT.unpack(message[: _COUNT.size].tobytes())
    end = _COUNT.size + count * _ENTRY.size
    if count != pieces or len(message) < end:
        raise FreescaleError(f"a CUDA IPC descriptor names {count} pieces, {pieces} expected")
    raw = message[_COUNT.size : end].tobytes()
    return Descriptor(gpu, mailbox, slot, list(map(Piece._make, _ENTRY.iter_unpack(raw))))


def slot_offset(sender: int, slot: int) -> int:
    """Where a sender's slot starts in a receiver's mailbox: every sender's slots, by the
    sender's place among the ranks of the host (``IpcPath.host_index``)."""
    return (sender * MAILBOX_SLOTS + slot) * MAILBOX_SLOT_BYTES


def pushed_slot(message: np.ndarray) -> int:
    """The mailbox slot a header's descriptor says its pieces were pushed into (-1: none, or
    no descriptor there); read without judging the header (``IpcPath.free_slots``)."""
    if len(message) < _COUNT.size:
        return -1
    slot = _COUNT.unpack(message[: _COUNT.size].tobytes())[2]
    return slot if 0 <= slot < MAILBOX_SLOTS else -1


class _Scratch:
    """A plain device allocation of the group's own (``cuMemAlloc``: always exportable), grown
    by replacement; replaced ones are freed with the group (a queued copy may still read)."""

    def __init__(self, device: int) -> None:
        self._device = device
        self.pointer = 0
        self.size = 0
        self.handle = b""
        self._retired: list[int] = []

    def fit(self, nbytes: int) -> None:
        if nbytes <= self.size:
            return
        cu = driver()
        replaced = cu.bind(self._device)
        try:
            pointer = ctypes.c_uint64()
            size = max(nbytes, 2 * self.size)
            cu.check(cu.mem_alloc(ctypes.byref(pointer), size), "cuMemAlloc")
            handle = IpcHandle()
            code = cu.ipc_get_mem_handle(ctypes.byref(handle), pointer.value)
            cu.check(code, "cuIpcGetMemHandle")
        finally:
            cu.restore(replaced)
        if self.pointer:
            self._retired.append(self.pointer)
        self.pointer, self.size, self.handle = pointer.value, size, bytes(handle)

    def close(self) -> None:
        cu = driver()
        for pointer in [*self._retired, self.pointer]:
            if pointer:
                cu.mem_free(pointer)
        self._retired, self.pointer, self.size = [], 0, 0


_Entry = tuple[bytes | None, int, int]  # (IPC handle, None: the scratch; offset; bytes)


class Export:
    """This rank's side of one IPC collective, made at the call: the sends pushed into peers'
    mailboxes, the descriptor for each peer, and the copies into scratch that memory IPC cannot
    export needs (queued before the ready flags).

    Args:
        path: the group's IPC path.
        seq: the collective's sequence number.
        ready: the event of the caller's stream at the call.
        sends: per peer, the send buffers meant for it, in message order.
    """

    def __init__(
        self, path: IpcPath, seq: int, ready: torch.cuda.Event, sends: dict[int, list[Any]]
    ) -> None:
        self.scratch_copies: list[tuple[int, Any]] = []  # (scratch offset, source bytes)
        pushed, self.push_flag = path.push(seq, ready, sends)
        # The peers that read this rank's memory (and whose "read yours" it waits for).
        self.readers = sorted(peer for peer in sends if peer not in pushed)
        entries: dict[int, list[_Entry]] = {}
        if self.readers:  # every send pushed (a small collective): no driver call left
            cu = driver()
            replaced = cu.bind(path.device)
            try:
                entries = self._locate({p: b for p, b in sends.items() if p not in pushed})
            finally:
                cu.restore(replaced)
        if self.scratch_copies:
            offset, last = self.scratch_copies[-1]
            path.scratch.fit(offset + len(last))
        # The allocation the descriptors name: a later collective may replace the scratch
        # before this one is queued (replaced ones live as long as the group).
        self.scratch_pointer = path.scratch.pointer
        self._gpu, self._mailbox = path.gpu, path.mailbox.handle
        self._descriptors = {
            peer: encode(
                self._gpu,
                self._mailbox,
                -1,
                [(h if h is not None else path.scratch.handle, o, n) for h, o, n in e],
            )
            for peer, e in entries.items()
        }
        for peer, (slot, places) in pushed.items():
            pieces = [(_NO_HANDLE, offset, nbytes) for offset, nbytes in places]
            self._descriptors[peer] = encode(self._gpu, self._mailbox, slot, pieces)

    def _locate(self, sends: dict[int, list[Any]]) -> dict[int, list[_Entry]]:
        """Per peer, (handle, offset, bytes) of each send; handle None: in the scratch
        allocation, at that offset (each distinct buffer copied there once)."""
        handles: dict[int, tuple[int, bytes] | None] = {}  # by pointer: (base, handle)
        scratch_at: dict[tuple[int, int], int] = {}  # (pointer, bytes) -> offset in scratch
        scratch_bytes = 0
        entries: dict[int, list[_Entry]] = {}
        for peer, buffers in sends.items():
            mine = entries[peer] = []
            for buffer in buffers:
                pointer = address(buffer)
                if pointer not in handles:
                    handles[pointer] = _export(pointer)
                found = handles[pointer]
                if found is not None:
                    base, handle = found
                    mine.append((handle, pointer - base, len(buffer)))
                    continue
                key = (pointer, len(buffer))
                if key not in scratch_at:
                    scratch_at[key] = scratch_bytes
                    self.scratch_copies.append((scratch_bytes, buffer))
                    scratch_bytes += -(-len(buffer) // 256) * 256
                mine.append((None, scratch_at[key], len(buffer)))
        return entries

    def descriptor(self, peer: int) -> np.ndarray:
        """The descriptor of the send buffers meant for ``peer`` (none: an empty one)."""
        found = self._descriptors.get(peer)
        return found if found is not None else encode(self._gpu, self._mailbox, -1, [])


def _export(pointer: int) -> tuple[int, bytes] | None:
    """(base, IPC handle) of the allocation holding ``pointer``, or None where IPC cannot export
    it (memory of the virtual memory management API, e.g. torch's expandable segments)."""
    cu = driver()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if cu.mem_get_address_range(ctypes.byref(base), ctypes.byref(size), pointer) != 0:
        return None
    handle = IpcHandle()
    if cu.ipc_get_mem_handle(ctypes.byref(handle), base.value) != 0:
        return None
    return base.value, bytes(handle)


class _PeerMaps:
    """One peer's allocations mapped into this process, by handle. Past ``_MAPS_PER_PEER`` the
    least recently used ones are unmapped, but only while the stream that may read them is idle
    and never one the collective being queued uses (the map grows instead)."""

    def __init__(self) -> None:
        self._maps: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    def pointer(self, handle: bytes, stream: torch.cuda.Stream, keep: set[bytes]) -> int:
        """The mapped address of ``handle``'s allocation; ``keep``: the handles of the
        collective being queued."""
        mapped = self._maps.get(handle)
        if mapped is not None:
            self._maps.move_to_end(handle)
            return mapped
        if len(self._maps) >= _MAPS_PER_PEER and stream.query():
            unused = [h for h in self._maps if h not in keep]  # least recently used first
            for old in unused[: len(self._maps) - _MAPS_PER_PEER + 1]:
                driver().ipc_close_mem_handle(self._maps.pop(old))
        mapped = self._maps[handle] = _open(handle)
        return mapped

    def close(self) -> None:
        cu = driver()
        for mapped in self._maps.values():
            cu.ipc_close_mem_handle(mapped)
        self._maps.clear()


def _open(handle: bytes) -> int:
    """Maps a peer's allocation (its IPC handle) into this process; returns its address."""
    value = IpcHandle.from_buffer_copy(handle)
    mapped_at = ctypes.c_uint64()
    code = driver().ipc_open_mem_handle(ctypes.byref(mapped_at), value, _LAZY_PEER_ACCESS)
    if code != 0:
        raise FreescaleError(
            f"cuIpcOpenMemHandle of a peer's memory failed with CUresult {code} (processes "
            "in separate containers, or GPUs without peer access?); cuda_path='staged' avoids "
            "CUDA IPC"
        )
    return mapped_at.value


class _Flags:
    """The flag words of one pair: this rank's (outgoing ring) and the peer's (incoming)."""

    def __init__(self, link: Link) -> None:
        self._rings = (link.host.out, link.host.inc)
        cu = driver()
        self._pages: list[int] = []
        bases = []
        try:
            for ring in self._rings:
                page = ring.base.ctypes.data
                _register(page, _FLAG_PAGE, "a ring's flag page")
                self._pages.append(page)
                device = ctypes.c_uint64()
                cu.check(
                    cu.host_get_device_pointer(ctypes.byref(device), ctypes.c_void_p(page), 0),
                    "cuMemHostGetDevicePointer",
                )
                bases.append(device.value)
        except FreescaleError:
            self.close()
            raise
        out, inc = bases
        self.my_ready, self.my_done = out + 8 * _READY, out + 8 * _DONE
        self.peer_ready, self.peer_done = inc + 8 * _READY, inc + 8 * _DONE
        self.my_pushed, self.peer_pushed = out + 8 * _PUSHED, inc + 8 * _PUSHED
        self.my_consumed = [out + 8 * (_CONSUMED + slot) for slot in range(MAILBOX_SLOTS)]
        self.my_pushes_done = out + 8 * _PUSHES_DONE

    def _peer_wrote(self, index: int, seq: int) -> bool:
        """Whether the CPU sees the peer's flag ``index`` at ``seq`` or past it."""
        ctrl = self._rings[1].ctrl
        return ctrl is not None and int(ctrl[index]) >= seq

    def peer_read(self, slot: int, seq: int) -> bool:
        """Whether the peer has read what this rank pushed into its ``slot`` for collective
        ``seq`` (its GPU's "read" flag, seen by the CPU in the shared page)."""
        return self._peer_wrote(_CONSUMED + slot, seq)

    def sees_ready(self, seq: int) -> bool:
        """Whether the CPU sees the peer's "my inputs of ``seq`` are ready"."""
        return self._peer_wrote(_READY, seq)

    def sees_done(self, seq: int) -> bool:
        """Whether the CPU sees the peer's "I have read yours" of ``seq``."""
        return self._peer_wrote(_DONE, seq)

    def release(self, seq: int) -> None:
        """Sets every flag of the pair that a peer's GPU writes far past ``seq`` (CPU stores):
        queued waits pass. Not "my pushes are done": this rank's own push stream always writes
        it, and the IPC stream's wait for it is its wait for the caller's stream."""
        value = seq + _RELEASE
        for ring in self._rings:
            if ring.ctrl is not None:
                for index in (_READY, _DONE, _PUSHED, *range(_CONSUMED, _CONSUMED + MAILBOX_SLOTS)):
                    ring.ctrl[index] = value

    def close(self) -> None:
        for page in self._pages:
            torch.cuda.cudart().cudaHostUnregister(page)
        self._pages = []


class GatedPulls:
    """The part of a collective that a GPU shared with a peer leaves to the CPU (see the module
    docstring): per peer still to pull from, its copies (destination, mapped source, bytes);
    the peers that read this rank's inputs and have not said so yet."""

    __slots__ = ("pulls", "readers", "seq", "watched")

    def __init__(
        self, seq: int, pulls: dict[int, list[tuple[int, int, int]]], readers: list[int]
    ) -> None:
        self.seq = seq
        self.pulls = pulls
        self.readers = readers
        self.watched = False  # the poller watches it (until it wakes the engine for it)

    @property
    def waiting_for(self) -> list[int]:
        """The peers whose flags this part still waits for."""
        return sorted({*self.pulls, *self.readers})


class _FlagPoller:
    """A thread that polls the flags gated pulls wait for and wakes the engine once one of them
    can move (no GPU work or file descriptor signals a flag that a peer's GPU writes into host
    memory). It polls only while something is watched, every ``_FLAG_POLL_S``."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._lock = threading.Lock()
        self._watched: list[Callable[[], bool]] = []
        self._more = threading.Event()
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name="freescale-comm-ipc-flags", daemon=True
        )
        self._thread.start()

    def watch(self, movable: Callable[[], bool]) -> None:
        """Wakes the engine once ``movable()`` is true, and forgets it."""
        with self._lock:
            self._watched.append(movable)
        self._more.set()

    def _run(self) -> None:
        while not self._closed:
            self._more.clear()
            with self._lock:
                watched = list(self._watched)
            if not watched:
                self._more.wait()
                continue
            moved = [check for check in watched if check()]
            if not moved:
                time.sleep(_FLAG_POLL_S)
                continue
            with self._lock:
                self._watched = [c for c in self._watched if c not in moved]
            self._wake()

    def close(self) -> None:
        self._closed = True
        self._more.set()
        self._thread.join(_CLOSE_WAIT_S)


class IpcPath:
    """One group's IPC machinery on one device: its streams, the pairs' flags, mapped peer
    memory, the mailbox and the scratch allocation. Made on the group's first IPC collective.

    Args:
        device: the CUDA device of the group's tensors.
        links: the shared-memory links with the peers on this host, by group rank.
        rank: this rank in the group.
        host_ranks: the group ranks on this host, in the same order on each of them (the
            mailbox has slots for each, whatever the group's size).
        watch: hands an event to a thread that wakes the group's waiting threads once it has
            completed (``cuda.StreamWatcher.watch``).
        wake: wakes the group's waiting threads (``Transport.wake``).
    """

    def __init__(
        self,
        device: int,
        links: dict[int, Link],
        rank: int,
        host_ranks: Sequence[int],
        watch: Callable[[torch.cuda.Event], None],
        wake: Callable[[], None],
    ) -> None:
        if driver().attribute(device, _CAN_USE_64_BIT_STREAM_MEM_OPS) != 1:
            raise FreescaleError(
                f"GPU {device} cannot order copies by 64-bit stream memory operations "
                "(cuStreamWaitValue64); cuda_path='staged' avoids CUDA IPC"
            )
        self.device = device
        self._rank = rank
        self._host_index = {r: k for k, r in enumerate(host_ranks)}
        self._maps: dict[int, _PeerMaps] = collections.defaultdict(_PeerMaps)
        self.scratch = _Scratch(device)
        # Every sender's slots, by place on the host (this rank's own go unused: simpler offsets).
        self.mailbox = _Scratch(device)
        self.mailbox.fit(len(host_ranks) * MAILBOX_SLOTS * MAILBOX_SLOT_BYTES)
        self._mailbox_handles: dict[int, bytes] = {}  # the peers' mailboxes, as learned
        self._mailbox_at: dict[int, int] = {}  # ... and where they are mapped here
        self._pushes: collections.Counter[int] = collections.Counter()  # per peer
        self._slot_seq: dict[tuple[int, int], int] = {}  # (peer, slot): its last push's seq
        # (peer, slot): the largest "read" flag value queued for it. A slot freed for a failed
        # collective off the IPC path is not held in call order (``free_slots``): a later
        # collective's read may be queued first, and a flag must never go back.
        self._read_queued: dict[tuple[int, int], int] = {}
        self._last_push = 0
        self._push_lock = threading.Lock()
        self.gpu = driver().device_uuid(device)
        self._last_seq = 0
        # IPC collectives started (``start``, call order) and not yet queued: queued in
        # sequence order, so that flags grow in stream order on every rank.
        self._unqueued: set[int] = set()
        # Failed collectives' mailbox slots still to free: (seq, {peer: slot}) (``free_slots``).
        self._unread: list[tuple[int, dict[int, int]]] = []
        self._order_lock = threading.Lock()
        # A peer on this same GPU (time-sliced contexts): a queued wait for it spins through
        # this context's time slice while the peer's context, which would meet it, cannot run;
        # collectives are then queued one at a time (``ready``).
        self.shares_gpu = False
        self._last_final: torch.cuda.Event | None = None
        self._watch = watch
        self._watched_final: torch.cuda.Event | None = None  # handed to ``watch`` by ``ready``
        self._wake = wake
        self._poller: _FlagPoller | None = None  # made by the first gated pulls
        self._aborted = False
        # One stream for every IPC collective of the group: collectives run in call order,
        # each one's flag writes before its waits (see the module docstring).
        self.stream = _new_stream(device)
        # The pushes of every collective, in call order (their flags grow in stream order).
        self.push_stream = _new_stream(device)
        # Page-locked now, before any wait is queued: registering memory may wait for the GPU.
        self._flags: dict[int, _Flags] = {}
        try:
            for peer, link in links.items():
                self._flags[peer] = _Flags(link)
        except FreescaleError:
            self.close()
            raise

    def push(
        self, seq: int, ready: torch.cuda.Event, sends: dict[int, list[Any]]
    ) -> tuple[dict[int, tuple[int, list[tuple[int, int]]]], int]:
        """Queues on the push stream the copies of the sends that fit a slot of a mailbox this
        rank has mapped (see the module docstring), then "my pushes of ``seq`` are done".

        Returns:
            Per peer pushed to: the slot and, per send, (offset in its mailbox, bytes); and the
            device address of the flag that reaches ``seq`` once the pushes are done (0:
            nothing pushed).
        """
        targets = {
            peer: buffers
            for peer, buffers in sends.items()
            if peer in self._mailbox_at and sum(len(b) for b in buffers) <= MAILBOX_SLOT_BYTES
        }
        if not targets:
            return {}, 0
        with self._push_lock:
            if seq <= self._last_push:  # started out of call order by another thread: pulled
                return {}, 0
            # Sends to a slot the receiver has not read yet are pulled (never waited for on
            # the GPU: see the module docstring).
            slots = {}
            for peer in targets:
                slot = self._pushes[peer] % MAILBOX_SLOTS
                previous = self._slot_seq.get((peer, slot))
                if previous is None or self._flags[peer].peer_read(slot, previous):
                    slots[peer] = slot
            if not slots:
                return {}, 0
            ops = StreamOps()
            stream = self.push_stream.cuda_stream
            ops.wait_event(stream, ready.cuda_event)
            pushed = {}
            for peer, slot in slots.items():
                offset = slot_offset(self.host_index(self._rank), slot)
                places = []
                for buffer in targets[peer]:
                    nbytes = len(buffer)
                    ops.copy(stream, self._mailbox_at[peer] + offset, address(buffer), nbytes)
                    places.append((offset, nbytes))
                    offset += nbytes
                ops.write(stream, self._flags[peer].my_pushed, seq)
                pushed[peer] = (slot, places)
            # One word of this rank's own: every push of the group writes one, in call order.
            done_flag = self._flags[next(iter(slots))].my_pushes_done
            ops.write(stream, done_flag, seq)
            ops.run(self.device)
            # Only once queued: a slot counted as pushed waits for the peer's "read" forever.
            self._last_push = seq
            for peer, slot in slots.items():
                self._pushes[peer] += 1
                self._slot_seq[peer, slot] = seq
        return pushed, done_flag

    def host_index(self, rank: int) -> int:
        """``rank``'s place among the ranks of this host (its slots in a mailbox)."""
        return self._host_index[rank]

    def pushes_to(self, peer: int) -> int:
        """How many collectives pushed their sends into ``peer``'s mailbox."""
        return self._pushes[peer]

    def learn_mailbox(self, peer: int, handle: bytes) -> None:
        """A peer's mailbox, named in its descriptor: mapped before the next collective is
        queued, pushed into from the call after that."""
        if handle != _NO_HANDLE:
            self._mailbox_handles.setdefault(peer, handle)

    def free_slots(self, seq: int, slots: dict[int, int]) -> None:
        """Frees the slots (by peer) that the peers pushed collective ``seq`` into, which
        failed its verdict unread (see the module docstring); queued by ``done_with``, which
        the failed collective calls next."""
        with self._order_lock:
            self._unread.append((seq, slots))

    def started(self, seq: int) -> None:
        """Collective ``seq`` takes this path (called in call order)."""
        self._unqueued.add(seq)

    def ready(self, seq: int) -> bool:
        """Whether collective ``seq`` may be queued now: every earlier one is (or gave up),
        and on a GPU shared with a peer the previous one has finished."""
        if min(self._unqueued) != seq:
            return False
        final = self._last_final
        if not self.shares_gpu or final is None or final.query():
            return True
        if self._watched_final is not final:  # nothing else need wake the waiting thread
            self._watched_final = final
            self._watch(final)
        return False

    def done_with(self, seq: int, final: torch.cuda.Event | None) -> None:
        """Collective ``seq`` is queued (ending with ``final``) or failed before that. The
        slots of failed collectives that every earlier collective is queued before are freed
        first, while ``seq`` still holds back every later one (``ready``)."""
        with self._order_lock:
            try:
                if self._unread:
                    rest = self._unqueued - {seq}  # one step: ``started`` may add meanwhile
                    self._free_unread_before(min(rest) if rest else None)
            finally:  # a later collective must not wait for this one, whatever happened
                if final is not None:
                    # Before ``seq`` leaves the queue: a thread that finds the next one first
                    # in line (``ready``) must see this one's end, not the one before.
                    self._last_final = final
                self._unqueued.discard(seq)

    def _free_unread_before(self, first_unqueued: int | None) -> None:
        """Queues the "read" flag writes of the failed collectives' slots that come before
        ``first_unqueued`` (None: all), in sequence order."""
        due = sorted(
            (u for u in self._unread if first_unqueued is None or u[0] < first_unqueued),
            key=lambda u: u[0],
        )
        if not due:
            return
        self._unread = [u for u in self._unread if u not in due]
        ops = StreamOps()
        for seq, slots in due:
            for peer, slot in slots.items():
                self._queue_read(ops, peer, slot, seq)
        ops.run(self.device)

    def _queue_read(self, ops: StreamOps, peer: int, slot: int, seq: int) -> None:
        """Adds to ``ops`` "I have read what you pushed into ``slot`` for ``seq``" on the IPC
        stream, never a value below one added before for that slot (``_order_lock`` held until
        ``ops`` has run, so that the writes reach the stream in the order of their values)."""
        value = max(seq, self._read_queued.get((peer, slot), 0))
        self._read_queued[peer, slot] = value
        ops.write(self.stream.cuda_stream, self._flags[peer].my_consumed[slot], value)

    def enqueue(
        self,
        seq: int,
        ready: torch.cuda.Event,
        export: Export,
        pushed_in: dict[int, tuple[int, list[tuple[Any, Piece]]]],
        pulls: dict[int, list[tuple[Any, Piece]]],
        local_copies: Sequence[tuple[Any, Any]],
    ) -> GatedPulls | None:
        """Queues one collective (steps 1-5 of the module docstring) on the IPC stream; on a GPU
        shared with a peer, steps 4 and 5 of the pulls are left to ``advance`` (returned).

        Args:
            seq: the collective's sequence number in the group (the same on every rank).
            ready: the event of the caller's stream at the call.
            export: this rank's side (its pushes, its readers, scratch copies to make first).
            pushed_in: per peer that pushed into this rank's mailbox: the slot, and per piece
                (destination bytes, where in the mailbox it lies).
            pulls: per peer this rank pulls from, in the order to visit them: (destination
                bytes, where they lie).
            local_copies: (destination, source) bytes of this rank's own piece.

        Returns:
            The pulls gated on the CPU (None: everything is queued).
        """
        stream = self.stream
        # Peers' new allocations mapped first: mapping may wait for the GPU (it took until the
        # queued matmuls were done in one measurement), and must never wait while a part of
        # this collective that a peer's queued waits need is still unqueued.
        sources = {}
        if pulls or len(self._mailbox_at) < len(self._mailbox_handles):
            cu = driver()
            replaced = cu.bind(self.device)  # mapping is a driver call of the context's
            try:
                for peer, pieces in pulls.items():
                    maps, keep = self._maps[peer], {p.handle for _, p in pieces}
                    sources[peer] = [
                        (address(dst), maps.pointer(p.handle, stream, keep) + p.offset, p.nbytes)
                        for dst, p in pieces
                    ]
                for peer, mailbox in self._mailbox_handles.items():
                    if peer not in self._mailbox_at:
                        self._mailbox_at[peer] = _open(mailbox)
            finally:
                cu.restore(replaced)
        ops = StreamOps()
        handle = stream.cuda_stream
        # The inputs are read until the pushes are done, which waited for ``ready`` on the push
        # stream: waiting for them waits for both.
        if export.push_flag:
            ops.wait(handle, export.push_flag, seq)
        else:
            ops.wait_event(handle, ready.cuda_event)
        self._last_seq = seq
        for offset, source in export.scratch_copies:
            ops.copy(handle, export.scratch_pointer + offset, address(source), len(source))
        for peer in export.readers:
            ops.write(handle, self._flags[peer].my_ready, seq)
        for dst, src in local_copies:
            ops.copy(handle, address(dst), address(src), len(src))
        with self._order_lock:  # a free on another thread queues "read" flags apart
            for peer, (slot, pieces) in pushed_in.items():
                ops.wait(handle, self._flags[peer].peer_pushed, seq)
                mailbox = self.mailbox.pointer
                for dst, piece in pieces:
                    ops.copy(handle, address(dst), mailbox + piece.offset, piece.nbytes)
                self._queue_read(ops, peer, slot, seq)
            gated = None
            # Gated only behind an idle caller's stream: the CPU then waits for the peers, and
            # where the caller queued GPU work, ``wait()`` must return before it is done.
            if self.shares_gpu and (sources or export.readers) and ready.query():
                gated = GatedPulls(seq, sources, list(export.readers))
            else:
                for peer, copies in sources.items():
                    ops.wait(handle, self._flags[peer].peer_ready, seq)
                    self._queue_pull(ops, peer, copies, seq)
                for peer in export.readers:
                    ops.wait(handle, self._flags[peer].peer_done, seq)
            ops.run(self.device)
        return gated

    def advance(self, gated: GatedPulls) -> bool:
        """Queues the copies from each peer whose ready flag the CPU now sees, each followed by
        "I have read yours".

        Returns:
            True once nothing is left: every pull queued, every reader's "I have read yours"
            seen (the collective's end may then be queued).

        Raises:
            FreescaleError: the group was aborted (its released flags say nothing of the
                peers' memory, which must not be read).
        """
        if self._aborted:
            raise FreescaleError("the group was aborted while its copies waited for a peer")
        seq = gated.seq
        met = [peer for peer in gated.pulls if self._flags[peer].sees_ready(seq)]
        if met:
            ops = StreamOps()
            for peer in met:
                self._queue_pull(ops, peer, gated.pulls.pop(peer), seq)
            ops.run(self.device)
        if not gated.pulls:
            gated.readers = [p for p in gated.readers if not self._flags[p].sees_done(seq)]
        return not gated.pulls and not gated.readers

    def _queue_pull(
        self, ops: StreamOps, peer: int, copies: list[tuple[int, int, int]], seq: int
    ) -> None:
        """Adds to ``ops`` the copies from ``peer`` (destination, mapped source, bytes) on the
        IPC stream, then "I have read yours" of ``seq``."""
        handle = self.stream.cuda_stream
        for dst, src, nbytes in copies:
            ops.copy(handle, dst, src, nbytes)
        ops.write(handle, self._flags[peer].my_done, seq)

    def watch(self, gated: GatedPulls, dropped: Callable[[], bool]) -> None:
        """Wakes the group's waiting threads once ``advance`` can move ``gated`` (a pull's
        ready flag, or once every pull is queued every reader's "I have read yours"), or once
        ``dropped()`` (its collective finished otherwise) or the group is aborted."""

        def movable() -> bool:
            seq = gated.seq
            if dropped() or self._aborted:
                moved = True
            elif gated.pulls:
                moved = any(self._flags[p].sees_ready(seq) for p in list(gated.pulls))
            else:
                moved = all(self._flags[p].sees_done(seq) for p in gated.readers)
            if moved:
                gated.watched = False
            return moved

        if self._poller is None:
            self._poller = _FlagPoller(self._wake)
        gated.watched = True
        self._poller.watch(movable)

    def release(self) -> None:
        """Lets every queued wait of the group pass (the group was aborted)."""
        self._aborted = True  # first: gated pulls must not take a released flag for a peer's
        for flags in self._flags.values():
            flags.release(self._last_seq)

    def drained(self) -> bool:
        """Whether the IPC and push streams have run everything queued on them."""
        return self.stream.query() and self.push_stream.query()

    def keep_released(self) -> None:
        """Releases the queued waits again while the streams have not drained (the group was
        aborted): a live peer's GPU may still write a flag of a collective it queued before
        the abort, setting it back below a wait queued here, which would hold the streams,
        and any caller that synchronizes with them, until the group is destroyed."""
        if not self.drained():
            self.release()

    def close(self) -> None:
        """Waits for the stream, then unmaps and frees. Waits still queued after
        ``_CLOSE_WAIT_S`` (the group destroyed in the middle of a collective) are released, again
        and again for as long once more (a peer's late flag write can undo a release); a stream
        that still does not drain keeps its memory (logged) rather than hang the shutdown."""
        if self._poller is not None:
            self._poller.close()
        start = time.monotonic()
        while not self.drained():
            waited = time.monotonic() - start
            if waited > 2 * _CLOSE_WAIT_S:
                logger.warning(
                    "freescale: the CUDA IPC stream did not drain within %.0f s; its mappings "
                    "and scratch memory are left to the process's end",
                    waited,
                )
                return
            if waited > _CLOSE_WAIT_S:
                self.release()
            time.sleep(0.001)
        cu = driver()
        replaced = cu.bind(self.device)
        try:
            _destroy_stream(self.device, self.stream)
            _destroy_stream(self.device, self.push_stream)
            for maps in self._maps.values():
                maps.close()
            for mapped in self._mailbox_at.values():
                cu.ipc_close_mem_handle(mapped)
            self._mailbox_at = {}
            for flags in self._flags.values():
                flags.close()
            self.scratch.close()
            self.mailbox.close()
        finally:
            cu.restore(replaced)
