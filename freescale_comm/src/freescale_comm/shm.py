"""Shared-memory rings between the ranks of one host, for host bytes and staged CUDA bytes.

Per ordered pair of ranks on one host (same ``host_identity()``), the receiver creates a ring of
slots in a ``/dev/shm`` segment; the sender maps it. A message is cut into slot-sized chunks:
the sender copies a chunk into the next free slot and publishes it (the slot header first, then
the ring's head counter); the receiver copies it out into the posted receive buffer and frees
the slot (the tail counter). Copying in and copying out of different chunks run at once in the
two processes. A data message whose receive is not posted yet (sent with its collective's
headers, before the receiver's verdict) waits in the ring until it is: then it is copied once,
straight into the output, and what follows it in the ring waits too — only until the
receiver's verdict on its collective, which needs no message behind it (a second header round,
``Channel.unstall``, lets it out first). A header (sub 0) that arrives before its receive is
copied out into a buffer of its own.

A host message above the rings' limit (``host_path="auto"``; ``shm_max_bytes``, by default 512 KiB
or none: ``GroupContext._ring_limit``) does not go through the slots: its sender posts one slot
naming where the bytes lie in its memory, and the receiver, once its receive is posted, reads
them straight into it with ``process_vm_readv`` (one copy, as UCX's cross-memory attach), then
counts the descriptor done in the ring's control block,
which completes the sends in the order they were posted. The count is not a slot: an answer queued
in the reader's own ring behind data it sent early for a later collective would wait for a receive
the sender posts only once this send completed. A sender that died makes the read fail with an
error, which fails the collective (UCX aborted the reading process there). Where the kernel refuses
the read (ptrace restrictions: it is probed at set-up, per direction; under Yama's ``ptrace_scope``
1 each process first allows it, ``allow_reads_by_peers``), those messages take UCX. A send still
unread when its channel closes keeps its buffer until the reader counts it, closes its side or exits
(``Hub`` holds it).

Segments are unlinked as soon as both sides have mapped them (their memory dies with the
processes); a segment that a crash left between creation and that point is named after its
creator's pid and removed by the next process that starts rings on the host.

Where CUDA is available a second pair of rings per pair (``Link.staging``, slots of the staging
chunk, sparse until first used) carries staged CUDA bytes: the same protocol, with copy-engine
copies into and out of the slots (``cuda.RingCopies``, which page-locks both rings in each
process) instead of memcpy; a copy that ends after it starts holds the ring's counters back
until it is done (``Channel``).

Every process has one datagram socket in the abstract namespace (no file): a side that
publishes or frees slots sends its peer one byte, which wakes the peer's progress thread from
its epoll sleep (``Transport.wait_event`` sleeps on this socket too) — only if the peer said it
sleeps (a flag in the control block of its incoming host ring): a peer that polls needs no
byte, and sending one costs a system call of about 10 microseconds.

Ordering: the counters are 8-byte aligned stores and loads, and the code relies on stores
becoming visible in program order (x86-64's TSO); on other architectures ``host_path="auto"``
does not use the rings.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import mmap
import os
import platform
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, NamedTuple, Protocol

import numpy as np

from freescale_comm.errors import FreescaleError
from freescale_comm.local_copies import run_here, start_reads
from freescale_comm.options import HOST_ENV

_PREFIX = "freescale-ring-"
_SHM_DIR = "/dev/shm"
# Head at byte 0, tail at 64; the CUDA IPC path's flags at 128 to 255 (``ipc``); at 256 whether
# the ring's receiver sleeps in its epoll (it wants a wake-up byte; odd: it does, the count of
# its sleeps begun and ended); at 320 how many read descriptors its receiver is done with, and
# whether it closed the ring (it reads no more): separate lines.
_CTRL_BYTES = 384
_ASLEEP = 32  # uint64 index of that flag
_READS_DONE = 40  # and of that count
_CLOSED = 41
_SLOT_HEADER = 4  # uint64: tag, message length, offset of the chunk, chunk length
_STALE_AFTER_S = 60.0
_RECLAIM_EVERY_S = 0.1  # how often progress checks whether lent sends came back
_SUB_BITS = 16  # transport.SUB_BITS: a tag's low bits number the messages of a collective
_SUB_MASK = (1 << _SUB_BITS) - 1  # 0: the collective's header (or diagnosis) message
# A slot header's offset field marks a read descriptor (its data: the sender's address); real
# offsets are below the message length.
_READ_FROM = 1 << 63
_PROBE_MAGIC = 0x6672656573636C65  # a probe word holds this xor its process id


def host_identity() -> str:
    """Which host this process runs on: ``FREESCALE_HOST_ID`` if set, else hostname and boot
    id (two containers with one hostname but separate kernels differ in the boot id)."""
    override = os.environ.get(HOST_ENV)
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def rings_supported() -> str | None:
    """Why rings cannot be used in this process, or None."""
    if not os.path.isdir(_SHM_DIR):
        return f"no {_SHM_DIR}"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"ring ordering is implemented for x86-64 only (this is {platform.machine()})"
    return None


def sweep_stale(now: float | None = None) -> list[str]:
    """Removes ring segments whose creating process is gone (a crash between creating and
    unlinking them); returns the names removed."""
    removed = []
    now = time.time() if now is None else now
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        try:
            pid = int(name[len(_PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        path = os.path.join(_SHM_DIR, name)
        try:
            if _alive(pid) or now - os.stat(path).st_mtime < _STALE_AFTER_S:
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


_process_vm_readv: Any = None


def read_process(pid: int, local: int, remote: int, nbytes: int) -> str | None:
    """Copies ``nbytes`` at address ``remote`` of process ``pid`` to ``local`` in this one
    (``process_vm_readv``, GIL released); returns why it failed, or None."""
    global _process_vm_readv
    if _process_vm_readv is None:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
        fn.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(_IoVec),
            ctypes.c_ulong,
            ctypes.POINTER(_IoVec),
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        fn.restype = ctypes.c_ssize_t
        _process_vm_readv = fn
    done = 0
    while done < nbytes:  # the kernel may copy less than asked
        into = _IoVec(local + done, nbytes - done)
        source = _IoVec(remote + done, nbytes - done)
        got = _process_vm_readv(pid, ctypes.byref(into), 1, ctypes.byref(source), 1, 0)
        if got <= 0:
            return os.strerror(ctypes.get_errno()) if got < 0 else "no bytes read"
        done += got
    return None


_YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = (1 << 64) - 1  # (unsigned long) -1


def allow_reads_by_peers(scope_file: str = _YAMA_SCOPE) -> bool:
    """Lets processes of this user read this one's memory where Yama's ``ptrace_scope`` is 1
    (Ubuntu's default: else only ancestors may, and ranks are siblings); True if the kernel
    took it. Like UCX's cross-memory attach, which makes the same call in every process that
    loads it and never takes it back, this lets any process of the user attach to this one,
    not only read it."""
    try:
        with open(scope_file) as f:
            if f.read().strip() != "1":
                return False
    except OSError:
        return False  # no Yama: reads follow the classic same-user rule
    prctl = ctypes.CDLL(None).prctl
    prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    prctl.restype = ctypes.c_int
    return prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0) == 0


def _can_read(pid: int, address: int) -> bool:
    """Whether this process may read process ``pid``'s memory: its probe word at ``address``."""
    word = np.zeros(1, dtype=np.uint64)
    return read_process(pid, word.ctypes.data, address, 8) is None and int(word[0]) == (
        _PROBE_MAGIC ^ pid
    )


class Request:
    """A shared-memory send or receive in flight (the interface of a UCX request).

    ``completed`` means: a send's bytes are all in the ring (its buffer may be reused); a
    receive's copies out of the ring are all done (host) or all queued, ``last`` being the
    copy engine's event that ends them (CUDA: the collective orders its own end after it).
    """

    __slots__ = (
        "buffer",
        "by_read",
        "completed",
        "done_bytes",
        "error",
        "keep",
        "last",
        "length",
        "ready",
        "tag",
    )

    def __init__(self, buffer: Any, tag: int, ready: Any = None, by_read: bool = False) -> None:
        self.buffer = buffer
        self.tag = tag
        # A send the receiver reads from this process's memory (complete once it says so).
        self.by_read = by_read
        self.done_bytes = 0
        self.completed = False
        self.error: str | None = None
        self.length = len(buffer)
        self.ready = ready  # CUDA: copies of this request wait for this event first
        self.last: Any = None
        # What owns a by_read send's memory, if its buffer does not (set by its collective):
        # a send lent past its channel's end (``Hub.lend``) keeps it alive until read.
        self.keep: Any = None

    def check_error(self) -> None:
        if self.error is not None:
            raise FreescaleError(self.error)


class HostCopies:
    """Copy-in and copy-out of host bytes: one memcpy on the calling thread, done at once."""

    @staticmethod
    def copy_in(slot: np.ndarray, request: Request, offset: int, n: int) -> None:
        np.copyto(slot, request.buffer[offset : offset + n])

    @staticmethod
    def copy_out(request: Request, offset: int, slot: np.ndarray) -> None:
        np.copyto(request.buffer[offset : offset + len(slot)], slot)

    @staticmethod
    def done(token: Any) -> bool:
        return True


class Copies(Protocol):
    """How a channel moves bytes into and out of its slots (``HostCopies``, or the CUDA copy
    engines of ``cuda.RingCopies``). A copy returns a token, None when it is already done."""

    def copy_in(self, slot: np.ndarray, request: Request, offset: int, n: int) -> Any: ...

    def copy_out(self, request: Request, offset: int, slot: np.ndarray) -> Any: ...

    def done(self, token: Any) -> bool: ...


class _Unexpected:
    """A message that arrived before its receive was posted."""

    __slots__ = ("data", "received", "request")

    def __init__(self, length: int) -> None:
        self.data = np.empty(length, dtype=np.uint8)
        self.received = 0
        self.request: Request | None = None


def map_segment(
    path: str, size: int, create: bool, reserve: bool = True
) -> tuple[mmap.mmap, int | None]:
    """Maps the ``/dev/shm`` segment ``path`` of ``size`` bytes: creates it (``create``) or
    checks the size of an existing one. ``reserve`` takes its memory now (a full ``/dev/shm``
    fails here, not as SIGBUS later); a sparse one's file descriptor is returned open, for
    ``os.posix_fallocate`` later (else None)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create and reserve:
            os.posix_fallocate(fd, 0, size)
        elif create:
            os.ftruncate(fd, size)
        elif os.fstat(fd).st_size != size:
            raise FreescaleError(f"{path} has {os.fstat(fd).st_size} bytes, not {size}")
        mapping = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    if reserve:
        os.close(fd)
        return mapping, None
    return mapping, fd


class Ring:
    """One direction of a pair: a segment of ``slots`` slots of ``slot_bytes``.

    Args:
        reserve: take the memory now (a full /dev/shm fails here, not as SIGBUS later);
            without it the segment is sparse until ``reserve`` is called (the CUDA staging
            rings, which a process that never stages CUDA bytes never touches).
    """

    def __init__(
        self, path: str, slots: int, slot_bytes: int, create: bool, reserve: bool = True
    ) -> None:
        self.path = path
        self.slots = slots
        self.slot_bytes = slot_bytes
        size = self.size = self.segment_bytes(slots, slot_bytes)
        # A sparse segment keeps its file for ``reserve`` (the name is unlinked soon).
        self._map, self._fd = map_segment(path, size, create, reserve)
        self.ctrl = np.frombuffer(self._map, dtype=np.uint64, count=_CTRL_BYTES // 8)
        self.headers = np.frombuffer(
            self._map, dtype=np.uint64, count=slots * _SLOT_HEADER, offset=_CTRL_BYTES
        ).reshape(slots, _SLOT_HEADER)
        data_at = _data_offset(slots)
        self.data = np.frombuffer(
            self._map, dtype=np.uint8, count=slots * slot_bytes, offset=data_at
        ).reshape(slots, slot_bytes)
        self.base = np.frombuffer(self._map, dtype=np.uint8)

    @staticmethod
    def segment_bytes(slots: int, slot_bytes: int) -> int:
        return _data_offset(slots) + slots * slot_bytes

    def reserve(self) -> None:
        """Takes the memory of a sparse segment (both sides may call it)."""
        if self._fd is not None:
            os.posix_fallocate(self._fd, 0, self.size)

    def close(self) -> None:
        self.ctrl = self.headers = self.data = self.base = None
        with contextlib.suppress(BufferError):
            self._map.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_FENCE = threading.Lock()


def full_fence() -> None:
    """Orders this thread's earlier stores before its later loads (x86-64 reorders a store
    after a later load of another address, the one reordering TSO allows): acquiring an
    uncontended lock is a locked read-modify-write, a full barrier there."""
    _FENCE.acquire()
    _FENCE.release()


def _data_offset(slots: int) -> int:
    return -(-(_CTRL_BYTES + slots * _SLOT_HEADER * 8) // 4096) * 4096


def _length_error(length: int, request: Request) -> str | None:
    """The error of a receive that a message of ``length`` bytes arrived for, or None: a
    header receive (sub 0) has room for the longest header, a data receive is exactly what its
    plan expects, so a shorter message means the ranks' calls disagree (only ``validate=False``
    lets them get this far)."""
    if length > request.length:
        return f"a message of {length} bytes arrived for a {request.length}-byte receive"
    if length < request.length and request.tag & _SUB_MASK:
        return (
            f"a message of {length} bytes arrived for a {request.length}-byte receive: the "
            "ranks' calls disagree (validate=False does not compare them before data moves)"
        )
    return None


def _retire_done(queue: collections.deque[tuple[Any, Request | None]], copies: Copies) -> int:
    """Pops the leading slots of ``queue`` whose copy is done (token ``None`` or done),
    completing the request a slot ends; returns how many slots it popped."""
    count = 0
    while queue and (queue[0][0] is None or copies.done(queue[0][0])):
        _, request = queue.popleft()
        count += 1
        if request is not None:
            request.completed = True
    return count


class _Read:
    """A read descriptor this rank took from the ring: its receive (None: dropped) and the
    parts of its read (None: not started yet; empty: nothing to read), until it is counted
    done."""

    __slots__ = ("length", "parts", "request")

    def __init__(
        self, request: Request | None, length: int, parts: list[Future[str | None]] | None
    ) -> None:
        self.request, self.length, self.parts = request, length, parts

    def done(self) -> bool:
        return self.parts is not None and all(part.done() for part in self.parts)

    def failure(self) -> str | None:
        """Why a part of the read failed, or None."""
        return read_failure(self.parts or ())


def read_failure(parts: Iterable[Future[str | None]]) -> str | None:
    """Why a part of a read of another process's memory failed (every part has ended), or
    None."""
    for part in parts:
        error = part.exception()
        if error is not None:
            return f"{type(error).__name__}: {error}"
        failed = part.result()
        if failed is not None:
            return failed
    return None


class Channel:
    """Both directions between this process and one peer over one pair of rings.

    The ring protocol: the sender reserves the next free slot, copies a chunk in and writes the
    slot header, and publishes the slot (the ring's head counter) once the copy is done; the
    receiver reads published slots in order, copies each out into the posted receive and frees
    it (the tail counter) once that copy is done. Copies that finish later than they start
    (``Copies`` tokens: CUDA copy engines) keep the counters behind them, so both counters
    still move in slot order.

    Args:
        device: the channel carries device bytes. A message whose receive is not posted then
            stays in the ring until it is (device bytes have nowhere else to go) instead of
            being copied out into a buffer of its own; it only waits for this rank's own
            verdict on its collective, which needs no message of this ring. A receive is
            complete once its copies are queued (``Request.last``).
        peer_pid: the peer's process id (reads of its memory).
        reads_out: the peer reads this rank's sends posted ``by_read`` from its memory.
        reads_in: this rank reads such sends of the peer (the same answer on both sides of a
            direction: probed at set-up by the reader, ``open_links``).
        read_threads: the process's reader threads that read such messages (1: the
            progressing thread reads each as it comes, one after another). With 2 or more, the
            reads that one progress pass over the process's rings finds (of this peer and
            others) run at once, a large one split between them, the last part on the
            progressing thread and the others on reader threads (``Hub.start_reads``); each
            wakes the process as it ends, and the channel counts them done in ring order.
    """

    DEVICE_CHUNKS_PER_PUSH = 2

    def __init__(
        self,
        hub: Hub,
        outgoing: Ring,
        incoming: Ring,
        peer_socket: bytes,
        device: bool = False,
        peer_pid: int = 0,
        reads_out: bool = False,
        reads_in: bool = False,
        read_threads: int = 1,
    ) -> None:
        self.hub = hub
        self.out = outgoing
        self.inc = incoming
        self.peer_socket = peer_socket
        self.copies: Copies = HostCopies()
        self._stall = device
        self._head = self._reserved = int(outgoing.ctrl[0])  # published / filled (sender)
        self._tail = self._consumed = int(incoming.ctrl[8])  # freed / read (receiver)
        # (token, request completed by this slot or None), per reserved or consumed slot.
        self._filling: collections.deque[tuple[Any, Request | None]] = collections.deque()
        self._draining: collections.deque[tuple[Any, Request | None]] = collections.deque()
        self._sends: collections.deque[Request] = collections.deque()
        self._recvs: dict[int, Request] = {}
        self._unexpected: dict[int, _Unexpected] = {}
        self.peer_pid = peer_pid
        self.reads_out, self.reads_in = reads_out, reads_in
        self.read_threads = read_threads
        self.split_reads = 0  # of ``reads``, those split between threads (tests check it)
        # Sends posted by_read, in ring order, until the peer counts them read; the counts.
        self._awaiting: collections.deque[Request] = collections.deque()
        self._reads_seen = int(outgoing.ctrl[_READS_DONE])
        self._reads_done = int(incoming.ctrl[_READS_DONE])
        self._reading: collections.deque[_Read] = collections.deque()  # in ring order
        # Of those, the reads to start at the end of the progress pass, and how.
        self._unstarted: list[tuple[_Read, Callable[[int, int], str | None]]] = []
        self.reads = 0  # messages this rank read from the peer's memory (tests check the path)
        self.closed = False
        # Collectives (tag >> SUB_BITS) whose early messages are dropped on arrival.
        self._discarded: collections.OrderedDict[int, None] = collections.OrderedDict()
        # Collectives whose data messages no longer wait in the ring for their receive.
        self._unstalled: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.sent = self.received = 0  # messages posted on this channel (tests check the path)
        # The ring whose control block holds the peer's "I sleep" flag (``_ASLEEP``): the one
        # it reads host bytes from (``Link`` points a staging channel at its host channel's).
        # The ring, not a view of it: a view would keep its mapping alive after ``close``.
        self.peer_flags = outgoing
        self._woken = 0  # the peer's sleep this channel last sent a wake-up byte in

    # --------------------------------------------------------------- posting (hub lock held)
    def send(self, buffer: Any, tag: int, ready: Any = None, by_read: bool = False) -> Request:
        """Posts a send; ``by_read`` (host bytes, ``reads_out``): the peer reads the bytes
        from this process's memory, which must stay as they are until the send completes (the
        request keeps the buffer, and ``Request.keep`` what owns its memory, alive even past
        the channel's end)."""
        request = Request(buffer, tag, ready, by_read)
        self.sent += 1
        self._sends.append(request)
        if self._push():
            self.wake_peer()
        return request

    def recv(self, buffer: Any, tag: int, ready: Any = None) -> Request:
        request = Request(buffer, tag, ready)
        self.received += 1
        early = self._unexpected.get(tag)
        if early is None:
            self._recvs[tag] = request
        elif early.received == len(early.data):
            del self._unexpected[tag]
            self._deliver(request, early.data)
        else:
            early.request = request
        return request

    # --------------------------------------------------------------- progress (hub lock held)
    def progress(self, start_reads: bool = True) -> bool:
        """Moves whatever can move in both directions; True if anything did. ``start_reads``:
        starts the reads it took from the ring (else the caller does, ``Hub.start_reads``)."""
        if self.closed:
            return False
        if (
            not (self._sends or self._filling or self._draining or self._awaiting)
            and not self._reading
            and int(self.inc.ctrl[0]) == self._consumed
        ):
            return False  # the common case, polled several times per collective and peer
        pulled = self._pull()
        if start_reads and self._unstarted:
            self.hub.start_reads([self])
        pushed = self._push() if self._sends or self._filling else False
        if pushed or pulled:
            self.wake_peer()
        return self._reads_counted() or pushed or pulled

    def _reads_counted(self) -> bool:
        """Completes the sends whose read the peer counted done; True if any."""
        done = int(self.out.ctrl[_READS_DONE])
        if done == self._reads_seen:
            return False
        for _ in range(done - self._reads_seen):
            self._awaiting.popleft().completed = True
        self._reads_seen = done
        return True

    def wake_peer(self, fenced: bool = False) -> None:
        """Sends the peer a wake-up byte if it sleeps and has not had one from this channel in
        this sleep; called after moving a counter (``fenced``: and a full fence since)."""
        if not fenced:
            full_fence()  # the counter's store before the flag's load (``Hub.sleeping``)
        sleep = int(self.peer_flags.ctrl[_ASLEEP])
        if sleep & 1 and sleep != self._woken:
            self._woken = sleep
            self.hub.signal(self.peer_socket)

    @property
    def peer_closed(self) -> bool:
        """Whether the peer closed its side (its group was destroyed, or its set-up failed)."""
        return int(self.out.ctrl[_CLOSED]) != 0

    @property
    def busy(self) -> bool:
        """Copies in flight (their completion wakes no epoll: the caller polls again)."""
        return bool(self._filling or self._draining)

    def _push(self) -> bool:
        ring = self.out
        slots, size = ring.slots, ring.slot_bytes
        reserved = self._reserved
        free = slots - (reserved - int(ring.ctrl[8]))
        if self._stall:
            # Device chunks are queued a few per progress call: queueing one costs tens of
            # microseconds, and the thread that queues them also judges this rank's headers
            # and queues the copies out of the incoming ring (which wait for that verdict).
            free = min(free, self.DEVICE_CHUNKS_PER_PUSH)
        copies = self.copies
        filling = self._filling
        while self._sends and free > 0:
            request = self._sends[0]
            if request.by_read:  # one slot: where the bytes lie
                k = reserved % slots
                ring.data[k, :8].view(np.uint64)[0] = request.buffer.ctypes.data
                ring.headers[k] = (request.tag, request.length, _READ_FROM, 8)
                self._awaiting.append(request)
                reserved += 1
                free -= 1
                self._sends.popleft()
                filling.append((None, None))
                continue
            offset = request.done_bytes
            n = min(size, request.length - offset)
            k = reserved % slots
            token = copies.copy_in(ring.data[k, :n], request, offset, n) if n else None
            ring.headers[k] = (request.tag, request.length, offset, n)
            reserved += 1
            free -= 1
            request.done_bytes = offset + n
            last = request.done_bytes >= request.length
            if last:
                self._sends.popleft()
            filling.append((token, request if last else None))
        self._reserved = reserved
        # Publish in slot order the slots whose copy is done: after the slot's bytes and header.
        head = self._head + _retire_done(filling, copies)
        if head == self._head:
            return False
        self._head = head
        ring.ctrl[0] = head
        return True

    def _pull(self) -> bool:
        ring = self.inc
        head = int(ring.ctrl[0])
        consumed = self._consumed
        moved = False
        slots = ring.slots
        copies = self.copies
        draining = self._draining
        while consumed < head:
            k = consumed % slots
            tag, length, offset, n = ring.headers[k].tolist()
            chunk = ring.data[k, :n]
            token, finished = None, None
            request = self._recvs.get(tag)
            if offset == _READ_FROM:
                if not self._read_slot(tag, length, chunk, request):
                    break  # its receive is posted once this rank has judged its collective
            elif request is not None:
                error = _length_error(length, request)
                if error is not None:
                    request.error = error
                    request.completed = True
                    del self._recvs[tag]
                else:
                    token = copies.copy_out(request, offset, chunk) if n else None
                    request.done_bytes += n
                    if request.done_bytes >= length:
                        del self._recvs[tag]
                        finished = request
                        request.last = token
            elif tag >> _SUB_BITS in self._discarded:
                pass  # sent early for a collective that failed its verdict
            elif self._stall or (tag & _SUB_MASK and tag >> _SUB_BITS not in self._unstalled):
                break  # its receive is posted once this rank has judged its collective
            else:
                early = self._unexpected.get(tag)
                if early is None:
                    early = self._unexpected[tag] = _Unexpected(length)
                np.copyto(early.data[offset : offset + n], chunk)
                early.received += n
                if early.received >= length and early.request is not None:
                    del self._unexpected[tag]
                    self._deliver(early.request, early.data)
            if finished is not None and (token is None or self._stall):
                # Host bytes are in place now; a device receive is complete once its copies
                # are queued (``last`` orders the collective's end after them).
                finished.completed = True
                finished = None
            draining.append((token, finished))
            consumed += 1
            moved = True
        self._consumed = consumed
        if self._reading and self._count_reads():
            moved = True
        tail = self._tail + _retire_done(draining, copies)
        if tail != self._tail:
            self._tail = tail
            ring.ctrl[8] = tail  # the slots are free again
            moved = True
        return moved

    def _read_slot(self, tag: int, length: int, chunk: np.ndarray, request: Request | None) -> bool:
        """Starts reading a read descriptor's bytes into its posted receive (``_count_reads``
        counts it done once read, and then the sender may reuse its buffer); a dropped one is
        counted too, so that the count completes the sender's sends in order. False: the
        receive is not posted yet (read descriptors travel only after the sender's verdict, so
        the receive comes with this rank's own)."""
        if request is None:
            if tag >> _SUB_BITS not in self._discarded:
                return False
            self._reading.append(_Read(None, length, []))
            return True
        del self._recvs[tag]
        error = _length_error(length, request)
        if error is not None:
            request.error = error
            self._reading.append(_Read(request, length, []))
            return True
        local, remote = request.buffer.ctypes.data, int(chunk.view(np.uint64)[0])
        pid = self.peer_pid
        if self.read_threads < 2:
            done = run_here(lambda: read_process(pid, local, remote, length))
            self._reading.append(_Read(request, length, [done]))
        else:
            entry = _Read(request, length, None)
            self._reading.append(entry)
            self._unstarted.append(
                (entry, lambda a, b: read_process(pid, local + a, remote + a, b - a))
            )
        return True

    def take_unstarted(self) -> list[tuple[_Read, Callable[[int, int], str | None]]]:
        """The reads taken from the ring and not started yet, which the caller starts."""
        taken, self._unstarted = self._unstarted, []
        return taken

    def _count_reads(self) -> bool:
        """Completes the leading reads that ended and counts them done for the sender (in ring
        order); True if any."""
        reading = self._reading
        if not (reading and reading[0].done()):
            return False
        while reading and reading[0].done():
            entry = reading.popleft()
            request, length = entry.request, entry.length
            if request is not None and request.error is None:
                failed = entry.failure()
                if failed is None:
                    request.done_bytes = length
                    self.reads += 1
                else:  # the collective fails, and with it the group
                    request.error = (
                        f"reading {length} bytes from process {self.peer_pid} failed: {failed} "
                        "(has it exited?)"
                    )
            if request is not None:
                request.completed = True  # after the error: a thread that sees it sees the error
            self._reads_done += 1
        self.inc.ctrl[_READS_DONE] = self._reads_done  # after the reads: the sender's bytes
        return True

    def _wait_for_reads(self, prefix: int | None = None) -> None:
        """Waits until no reader thread writes into a receive of collective ``prefix`` (None:
        of any); bounded, a copy out of another process's memory."""
        concurrent.futures.wait(
            [
                part
                for entry in self._reading
                if entry.request is not None
                and (prefix is None or entry.request.tag >> _SUB_BITS == prefix)
                for part in entry.parts or ()
            ]
        )

    def discard(self, prefix: int) -> None:
        """Drops the messages of one collective (``tag >> SUB_BITS == prefix``) that failed
        (its verdict, or later): those that arrived or will arrive, and its receives still
        posted, whose buffers the caller may reuse once it has seen the failure (on a staging
        channel, copies of earlier chunks already queued on its streams still land there).
        Its reads from the peer's memory not started yet are dropped, and it waits for those
        running (a copy each), then counts them done for the sender."""
        for tag in [t for t in self._unexpected if t >> _SUB_BITS == prefix]:
            del self._unexpected[tag]
        for tag in [t for t in self._recvs if t >> _SUB_BITS == prefix]:
            del self._recvs[tag]
        for entry, _ in self._unstarted:
            if entry.request is not None and entry.request.tag >> _SUB_BITS == prefix:
                entry.request, entry.parts = None, []  # counted, never read
        self._unstarted = [(entry, job) for entry, job in self._unstarted if entry.parts is None]
        self._wait_for_reads(prefix)
        if not self.closed and self._count_reads():  # (a closed channel's rings are unmapped)
            self.wake_peer()
        self._discarded[prefix] = None
        while len(self._discarded) > 256:
            self._discarded.popitem(last=False)

    def unstall(self, prefix: int) -> None:
        """Lets the data messages of one collective that wait in the ring for their receive
        be copied out into buffers of their own: a second header round of that collective
        (``Collective._diagnose``) follows them in the ring."""
        self._unstalled[prefix] = None
        while len(self._unstalled) > 256:
            self._unstalled.popitem(last=False)

    def forget(self, prefix: int) -> None:
        """Ends ``discard`` and ``unstall`` of ``prefix``: a later collective's tags repeat it
        once the sequence number wraps."""
        self._discarded.pop(prefix, None)
        self._unstalled.pop(prefix, None)

    @staticmethod
    def _deliver(request: Request, data: np.ndarray) -> None:
        error = _length_error(len(data), request)
        if error is not None:
            request.error = error
        else:
            np.copyto(request.buffer[: len(data)], data)
            request.done_bytes = len(data)
        request.completed = True

    def close(self) -> None:
        """Unmaps the rings (hub lock held), once no reader thread writes into a receive (reads
        not started yet are dropped). Sends the peer has not counted read yet (a group
        destroyed during a collective) go to the hub with their ring: the peer may still read
        their buffers, which must not be freed and reused under it."""
        if self.closed:
            return
        self.closed = True
        self._wait_for_reads()  # their receives' owners may free them once this returns
        self._unstarted.clear()
        self._reading.clear()
        self._sends.clear()
        self._recvs.clear()
        self._unexpected.clear()
        self._filling.clear()
        self._draining.clear()
        self._reads_counted()
        if self._awaiting:
            self.hub.lend(_Lent(self.out, self._reads_seen, list(self._awaiting), self.peer_pid))
        else:
            self.out.close()
        self._awaiting.clear()
        self.inc.ctrl[_CLOSED] = 1  # the peer's lent sends, if any, are returned
        self.inc.close()


class _Lent(NamedTuple):
    """Sends of a closed channel that its peer may still read (``Channel.close``)."""

    ring: Ring  # the outgoing ring: its control block counts the reads done
    seen: int  # the count when the channel closed
    sends: list[Request]  # their buffers hold their memory
    peer_pid: int

    def returned(self) -> bool:
        ctrl = self.ring.ctrl
        done = int(ctrl[_READS_DONE]) - self.seen >= len(self.sends) or int(ctrl[_CLOSED]) != 0
        return done or not _alive(self.peer_pid)


class Link:
    """Everything between this process and one peer of a group on the same host: the rings of
    host bytes, and (where both sides made them) the staging rings of CUDA bytes, whose slots
    the CUDA side page-locks on first use and copies into and out of with copy engines."""

    def __init__(self, host: Channel, staging: Channel | None = None) -> None:
        self.host = host
        self.staging = staging
        if staging is not None:
            # The staging rings stay sparse until used: the flag lives in the host rings only.
            staging.peer_flags = host.peer_flags
        self.out, self.inc = host.out, host.inc

    @property
    def sent(self) -> int:
        return self.host.sent

    @property
    def received(self) -> int:
        return self.host.received

    @property
    def busy(self) -> bool:
        return self.staging is not None and self.staging.busy

    def progress(self) -> bool:
        """Progresses both channels; the host channel's reads are left for the hub to start
        with those of the other links (``Hub.start_reads``)."""
        moved = self.host.progress(start_reads=False)
        if self.staging is not None:
            moved |= self.staging.progress()
        return moved

    def channel(self, buffer: Any) -> Channel:
        """The channel for ``buffer``: host bytes (numpy) or device bytes (staging rings)."""
        if isinstance(buffer, np.ndarray):
            return self.host
        if self.staging is None:
            raise FreescaleError("no staging rings with this peer for device bytes")
        return self.staging

    def discard(self, prefix: int) -> None:
        self.host.discard(prefix)
        if self.staging is not None:
            self.staging.discard(prefix)

    def forget(self, prefix: int) -> None:
        self.host.forget(prefix)
        if self.staging is not None:
            self.staging.forget(prefix)

    def close(self) -> None:
        self.host.close()
        if self.staging is not None:
            self.staging.close()


class Hub:
    """The process's rings: their progress, its wake-up socket, sweeping of leftovers."""

    _instance: Hub | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.links: list[Link] = []
        self.outboxes: list[Any] = []  # ``outbox.Outboxes``: their counters count as moves
        self._sleepers = 0  # threads in ``sleeping``
        self._sleep_count = 0  # sleeps begun and ended: odd while one lasts
        self.name = f"\0freescale-{os.getpid()}-{uuid.uuid4().hex[:12]}".encode()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        self.sock.bind(self.name)
        self.fd = self.sock.fileno()
        # A word peers read to learn whether the kernel lets them read this process's memory.
        self.probe = np.array([_PROBE_MAGIC ^ os.getpid()], dtype=np.uint64)
        self._lent: list[_Lent] = []
        self._reclaimed_at = 0.0
        sweep_stale()

    @classmethod
    def get(cls) -> Hub:
        with cls._lock:
            if cls._instance is None:
                cls._instance = Hub()
            return cls._instance

    def segment_path(self, tag: str) -> str:
        return os.path.join(_SHM_DIR, f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}-{tag}")

    def signal(self, peer_socket: bytes) -> None:
        with contextlib.suppress(BlockingIOError, ConnectionRefusedError, FileNotFoundError):
            self.sock.sendto(b"w", peer_socket)

    def add(self, link: Link) -> None:
        with self.lock:
            self.links.append(link)
            self._reclaim()

    def detach(self, link: Link) -> None:
        """Stops progressing ``link`` (no thread does once this returns); ``remove`` closes it.
        A group detaches its links before freeing the CUDA streams its staging channel uses."""
        with self.lock:
            if link in self.links:
                self.links.remove(link)

    def remove(self, link: Link) -> None:
        """Detaches ``link`` (if still attached) and closes it."""
        self.detach(link)
        with self.lock:
            link.close()
            self._reclaim()

    def lend(self, lent: _Lent) -> None:
        """Holds sends a closed channel's peer may still read (hub lock held), until it has
        read them, closed its side or exited: checked whenever a link comes or goes, and
        every ``_RECLAIM_EVERY_S`` while links are progressed (with no group left, they stay
        until the next one comes)."""
        self._lent.append(lent)

    def _reclaim(self) -> None:
        self._reclaimed_at = time.monotonic()
        keep = []
        for lent in self._lent:
            if lent.returned():
                lent.ring.close()
            else:
                keep.append(lent)
        self._lent = keep

    def watch(self, outboxes: Any) -> None:
        with self.lock:
            self.outboxes.append(outboxes)

    def unwatch(self, outboxes: Any) -> None:
        with self.lock:
            if outboxes in self.outboxes:
                self.outboxes.remove(outboxes)

    def progress(self) -> bool:
        """Progresses every link, unless another thread is doing it right now; True if a
        ring or an outbox counter moved."""
        if not self.links or not self.lock.acquire(blocking=False):
            return False
        try:
            moved = False
            try:
                for link in self.links:
                    moved |= link.progress()
            finally:  # no read taken from a ring is left unstarted
                moved |= self.start_reads(link.host for link in self.links)
            for outboxes in self.outboxes:
                moved |= outboxes.moved()
            if self._lent and time.monotonic() - self._reclaimed_at > _RECLAIM_EVERY_S:
                self._reclaim()
            return moved
        finally:
            self.lock.release()

    def start_reads(self, channels: Iterable[Channel]) -> bool:
        """Starts the reads that ``channels`` took from their rings (hub lock held): at once,
        the last part on this thread (``local_copies.start_reads``), then counts those done;
        True if any started."""
        taken = [(c, entry, job) for c in channels for entry, job in c.take_unstarted()]
        if not taken:
            return False
        started = start_reads(
            [(job, entry.length, c.read_threads) for c, entry, job in taken],
            wake=lambda: self.signal(self.name),
        )
        for (channel, entry, _), parts in zip(taken, started, strict=True):
            entry.parts = parts
            channel.split_reads += len(parts) > 1
        for channel in dict.fromkeys(c for c, _, _ in taken):
            if channel._count_reads():
                channel.wake_peer()
        return True

    @contextlib.contextmanager
    def sleeping(self) -> Iterator[bool]:
        """Around an epoll sleep: tells the peers to send wake-up bytes while it lasts, and
        yields whether the sleep may start (False: the rings moved after the flags were set).

        The flags are stored before the rings are read again, and a peer moves a counter
        before it reads the flag (``Channel.wake_peer``): with a full fence on both sides,
        either the peer sees the flag or this side sees the counter, so no wake-up is lost.
        """
        self._count_sleeper(1)
        try:
            full_fence()
            yield not self.progress()
        finally:
            self._count_sleeper(-1)

    def _count_sleeper(self, change: int) -> None:
        with self.lock:  # links are closed under it
            self._sleepers += change
            if self._sleepers == (1 if change > 0 else 0):
                self._sleep_count += 1  # odd: asleep (the count tells one sleep from the next)
                for link in self.links:
                    link.host.inc.ctrl[_ASLEEP] = self._sleep_count

    def drain(self) -> None:
        """Reads the wake-up bytes that arrived (the epoll sleep ended on them)."""
        with contextlib.suppress(BlockingIOError):
            for _ in range(256):
                self.sock.recv(64)

    def discard(self, link: Link, prefix: int) -> None:
        with self.lock:
            link.discard(prefix)

    def unstall(self, link: Link, prefix: int) -> None:
        with self.lock:
            link.host.unstall(prefix)

    def forget(self, link: Link, prefix: int) -> None:
        with self.lock:
            link.forget(prefix)

    def post(
        self,
        link: Link,
        buffer: Any,
        tag: int,
        send: bool,
        ready: Any = None,
        by_read: bool = False,
    ) -> Request:
        """Posts a send or receive of host bytes (numpy) or device bytes (staging rings; CUDA
        copies ordered after the event ``ready``); ``by_read``: a host send the peer reads
        from this process's memory (``Channel.send``)."""
        with self.lock:
            channel = link.channel(buffer)
            if send:
                return channel.send(buffer, tag, ready, by_read)
            return channel.recv(buffer, tag, ready)


def open_links(
    store: Any,
    rank: int,
    peers: list[int],
    slots: int,
    slot_bytes: int,
    timeout_s: float,
    staging: tuple[int, int] | None = None,
    reads: bool = False,
    read_threads: int = 1,
) -> tuple[dict[int, Link], dict[int, str]]:
    """Sets up the rings with ``peers`` (group ranks on this host) through the group's store.

    Every rank of the group calls it (with an empty list where it has no such peer). Returns
    the links, and for each peer whose link could not be made, why (both sides of a pair reach
    the same answer: a pair is used only if both sides mapped both rings).

    Args:
        staging: (slots, slot bytes) of the sparse CUDA staging rings to make beside the host
            rings (a process with CUDA); a pair has them only if both sides made and mapped
            them.
        reads: large host messages may be read from the sender's memory (``Channel``); a
            direction does so only if both of its ranks ask and its receiver could read a
            word of the sender's (the kernel may forbid it: ptrace restrictions).
        read_threads: threads that read one such message (``Channel``).
    """
    hub = Hub.get()
    pid = os.getpid()
    hub.probe[0] = _PROBE_MAGIC ^ pid
    if reads and peers:
        allow_reads_by_peers()
    probe = f"{pid}:{hub.probe.ctypes.data}" if reads else "-"
    peer_pids: dict[int, int] = {}
    reads_in: dict[int, bool] = {}  # per peer: this rank reads its large messages
    mine: dict[int, list[Ring]] = {}
    failures: dict[int, str] = {}
    theirs: dict[int, tuple[list[Ring], bytes]] = {}
    links: dict[int, Link] = {}
    wait = timedelta(seconds=timeout_s)
    try:
        for peer in peers:
            made: list[Ring] = []
            paths = [hub.segment_path(f"{peer}to{rank}")]
            try:
                made.append(Ring(paths[0], slots, slot_bytes, create=True))
                if staging is not None:
                    paths.append(hub.segment_path(f"stage-{peer}to{rank}"))
                    made.append(Ring(paths[1], *staging, create=True, reserve=False))
            except OSError as err:
                for ring in made:
                    ring.close()
                for path in paths:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                store.set(f"freescale/shm/{peer}to{rank}", "")
                failures[peer] = f"could not create a ring in {_SHM_DIR}: {err}"
                continue
            mine[peer] = made  # unlinked below if the store fails from here on
            store.set(f"freescale/shm/{peer}to{rank}", "\n".join([hub.name.hex(), probe, *paths]))
        # Bounded: a peer that died during set-up fails it within the group timeout.
        store.wait([f"freescale/shm/{rank}to{peer}" for peer in peers], wait)
        for peer in peers:
            entry = store.get(f"freescale/shm/{rank}to{peer}").decode()
            ok = False
            if not entry:
                failures.setdefault(peer, f"rank {peer} could not create its ring in {_SHM_DIR}")
            else:
                name, peer_probe, *paths = entry.split("\n")
                rings: list[Ring] = []
                if peer_probe != "-":
                    peer_pids[peer] = int(peer_probe.split(":")[0])
                    reads_in[peer] = reads and _can_read(*map(int, peer_probe.split(":")))
                try:
                    rings.append(Ring(paths[0], slots, slot_bytes, create=False))
                    if staging is not None and len(paths) > 1:
                        rings.append(Ring(paths[1], *staging, create=False, reserve=False))
                    theirs[peer] = (rings, bytes.fromhex(name))
                    ok = True
                except (OSError, FreescaleError) as err:
                    for ring in rings:
                        ring.close()
                    failures.setdefault(peer, f"could not map rank {peer}'s ring: {err}")
            answer = f"1{len(theirs[peer][0])}{'r' if reads_in.get(peer) else ''}" if ok else "0"
            store.set(f"freescale/shm_ok/{rank}to{peer}", answer)
        store.wait([f"freescale/shm_ok/{peer}to{rank}" for peer in peers], wait)
        for peer in peers:
            answer = store.get(f"freescale/shm_ok/{peer}to{rank}").decode()
            if answer.startswith("1") and peer in theirs and peer in mine:
                (out, *out_staging), name = theirs.pop(peer)
                inc, *inc_staging = mine.pop(peer)
                host = Channel(
                    hub,
                    out,
                    inc,
                    name,
                    peer_pid=peer_pids.get(peer, 0),
                    reads_out=answer.endswith("r"),
                    reads_in=reads_in.get(peer, False),
                    read_threads=read_threads,
                )
                # Staging rings only where both directions were made and mapped.
                stage = None
                if out_staging and inc_staging and answer[:2] == "12":
                    stage = Channel(hub, out_staging[0], inc_staging[0], name, device=True)
                else:
                    for ring in inc_staging:  # this rank's own: its name goes too
                        with contextlib.suppress(OSError):
                            os.unlink(ring.path)
                    for ring in out_staging + inc_staging:
                        ring.close()
                links[peer] = Link(host, stage)
                hub.add(links[peer])
            else:
                failures.setdefault(peer, f"rank {peer} could not map this rank's ring")
        # Both sides of every pair have mapped (or given up on) every ring: unlink the names, so
        # that the memory goes away with the processes whatever happens to them.
        for link in links.values():
            for channel in (link.host, link.staging):
                if channel is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(channel.inc.path)
    except BaseException:
        for link in links.values():
            for channel in (link.host, link.staging):
                if channel is not None:  # this rank's own ring: its name goes too
                    with contextlib.suppress(OSError):
                        os.unlink(channel.inc.path)
            hub.remove(link)
        raise
    finally:
        # The rings no link uses (all of them if set-up failed): this rank's go, names and
        # all; the peers' are unmapped.
        for rings in mine.values():
            for ring in rings:
                with contextlib.suppress(OSError):
                    os.unlink(ring.path)
                ring.close()
        for rings, _ in theirs.values():
            for ring in rings:
                ring.close()
    return links, failures
