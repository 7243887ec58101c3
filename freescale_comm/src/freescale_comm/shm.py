"""Shared-memory rings between the ranks of one host, for host (CPU) bytes.

Per ordered pair of ranks on one host (same ``host_identity()``), the receiver creates a ring of
slots in a ``/dev/shm`` segment; the sender maps it. A message is cut into slot-sized chunks:
the sender copies a chunk into the next free slot and publishes it (the slot header first, then
the ring's head counter); the receiver copies it out into the posted receive buffer and frees
the slot (the tail counter). Copying in and copying out of different chunks run at once in the
two processes. A message whose receive is not posted yet is copied out into a buffer of its own,
so no slot stays taken by it and messages of different collectives never wait on each other.

Segments are unlinked as soon as both sides have mapped them (their memory dies with the
processes); a segment that a crash left between creation and that point is named after its
creator's pid and removed by the next process that starts rings on the host.

Every process has one datagram socket in the abstract namespace (no file): a side that
publishes or frees slots sends its peer one byte, which wakes the peer's progress thread from
its epoll sleep (``Transport.wait_event`` sleeps on this socket too).

Ordering: the counters are 8-byte aligned stores and loads, and the code relies on stores
becoming visible in program order (x86-64's TSO); on other architectures ``host_path="auto"``
does not use the rings.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import platform
import socket
import threading
import time
import uuid
from typing import Any

import numpy as np

from freescale_comm.errors import FreescaleError

HOST_ENV = "FREESCALE_HOST_ID"
_PREFIX = "freescale-ring-"
_SHM_DIR = "/dev/shm"
_CTRL_BYTES = 128  # head at byte 0, tail at byte 64 (separate cache lines)
_SLOT_HEADER = 4  # uint64: tag, message length, offset of the chunk, chunk length
_STALE_AFTER_S = 60.0
_SUB_BITS = 16  # transport.SUB_BITS: a tag's low bits number the messages of a collective


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


class Request:
    """A shared-memory send or receive in flight (the interface of a UCX request)."""

    __slots__ = ("buffer", "completed", "done_bytes", "error", "length", "tag")

    def __init__(self, buffer: np.ndarray, tag: int) -> None:
        self.buffer = buffer
        self.tag = tag
        self.length = len(buffer)
        self.done_bytes = 0
        self.completed = False
        self.error: str | None = None

    def check_error(self) -> None:
        if self.error is not None:
            raise FreescaleError(self.error)


class _Unexpected:
    """A message that arrived before its receive was posted."""

    __slots__ = ("data", "received", "request")

    def __init__(self, length: int) -> None:
        self.data = np.empty(length, dtype=np.uint8)
        self.received = 0
        self.request: Request | None = None


class Ring:
    """One direction of a pair: a segment of ``slots`` slots of ``slot_bytes``."""

    def __init__(self, path: str, slots: int, slot_bytes: int, create: bool) -> None:
        self.path = path
        self.slots = slots
        self.slot_bytes = slot_bytes
        size = self.segment_bytes(slots, slot_bytes)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                # Reserves the memory now: a full /dev/shm fails here, not as SIGBUS later.
                os.posix_fallocate(fd, 0, size)
            elif os.fstat(fd).st_size != size:
                raise FreescaleError(f"{path} has {os.fstat(fd).st_size} bytes, not {size}")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.ctrl = np.frombuffer(self._map, dtype=np.uint64, count=_CTRL_BYTES // 8)
        self.headers = np.frombuffer(
            self._map, dtype=np.uint64, count=slots * _SLOT_HEADER, offset=_CTRL_BYTES
        ).reshape(slots, _SLOT_HEADER)
        data_at = _data_offset(slots)
        self.data = np.frombuffer(
            self._map, dtype=np.uint8, count=slots * slot_bytes, offset=data_at
        ).reshape(slots, slot_bytes)

    @staticmethod
    def segment_bytes(slots: int, slot_bytes: int) -> int:
        return _data_offset(slots) + slots * slot_bytes

    def close(self) -> None:
        self.ctrl = self.headers = self.data = None
        with contextlib.suppress(BufferError):
            self._map.close()


def _data_offset(slots: int) -> int:
    return -(-(_CTRL_BYTES + slots * _SLOT_HEADER * 8) // 4096) * 4096


class Link:
    """Both directions between this process and one peer of a group on the same host."""

    def __init__(self, hub: Hub, outgoing: Ring, incoming: Ring, peer_socket: bytes) -> None:
        self.hub = hub
        self.out = outgoing
        self.inc = incoming
        self.peer_socket = peer_socket
        self._head = int(outgoing.ctrl[0])  # slots this side published (sender)
        self._tail = int(incoming.ctrl[8])  # slots this side consumed (receiver)
        self._sends: collections.deque[Request] = collections.deque()
        self._recvs: dict[int, Request] = {}
        self._unexpected: dict[int, _Unexpected] = {}
        self.closed = False
        # Collectives (tag >> SUB_BITS) whose early messages are dropped on arrival.
        self._discarded: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.sent = self.received = 0  # messages posted on this link (tests check the path)

    # --------------------------------------------------------------- posting (hub lock held)
    def send(self, buffer: np.ndarray, tag: int) -> Request:
        request = Request(buffer, tag)
        self.sent += 1
        self._sends.append(request)
        if self._push():
            self.hub.signal(self.peer_socket)
        return request

    def recv(self, buffer: np.ndarray, tag: int) -> Request:
        request = Request(buffer, tag)
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
    def progress(self) -> bool:
        """Moves whatever can move in both directions; True if anything did."""
        if self.closed:
            return False
        pulled = self._pull()
        pushed = self._push() if self._sends else False
        if pushed or pulled:
            self.hub.signal(self.peer_socket)
        return pushed or pulled

    def _push(self) -> bool:
        ring = self.out
        slots, size = ring.slots, ring.slot_bytes
        head = self._head
        free = slots - (head - int(ring.ctrl[8]))
        moved = False
        while self._sends and free > 0:
            request = self._sends[0]
            offset = request.done_bytes
            n = min(size, request.length - offset)
            k = head % slots
            if n:
                np.copyto(ring.data[k, :n], request.buffer[offset : offset + n])
            ring.headers[k] = (request.tag, request.length, offset, n)
            head += 1
            ring.ctrl[0] = head  # publish: after the slot's bytes and header
            free -= 1
            moved = True
            request.done_bytes = offset + n
            if request.done_bytes >= request.length:
                request.completed = True
                self._sends.popleft()
        self._head = head
        return moved

    def _pull(self) -> bool:
        ring = self.inc
        head = int(ring.ctrl[0])
        tail = self._tail
        if tail == head:
            return False
        slots = ring.slots
        while tail < head:
            k = tail % slots
            tag, length, offset, n = ring.headers[k].tolist()
            chunk = ring.data[k, :n]
            request = self._recvs.get(tag)
            if request is not None:
                if length > request.length:
                    request.error = (
                        f"a message of {length} bytes arrived for a {request.length}-byte receive"
                    )
                    request.completed = True
                    del self._recvs[tag]
                else:
                    np.copyto(request.buffer[offset : offset + n], chunk)
                    request.done_bytes += n
                    if request.done_bytes >= length:
                        request.completed = True
                        del self._recvs[tag]
            elif tag >> _SUB_BITS in self._discarded:
                pass  # sent early for a collective that failed its verdict
            else:
                early = self._unexpected.get(tag)
                if early is None:
                    early = self._unexpected[tag] = _Unexpected(length)
                np.copyto(early.data[offset : offset + n], chunk)
                early.received += n
                if early.received >= length and early.request is not None:
                    del self._unexpected[tag]
                    self._deliver(early.request, early.data)
            tail += 1
            ring.ctrl[8] = tail  # the slot is free again
        self._tail = tail
        return True

    def discard(self, prefix: int) -> None:
        """Drops the messages of one collective (``tag >> SUB_BITS == prefix``) that arrived
        or will arrive without a receive (early data of a collective that failed its verdict).
        """
        for tag in [t for t in self._unexpected if t >> _SUB_BITS == prefix]:
            del self._unexpected[tag]
        self._discarded[prefix] = None
        while len(self._discarded) > 256:
            self._discarded.popitem(last=False)

    @staticmethod
    def _deliver(request: Request, data: np.ndarray) -> None:
        if len(data) > request.length:
            request.error = (
                f"a message of {len(data)} bytes arrived for a {request.length}-byte receive"
            )
        else:
            np.copyto(request.buffer[: len(data)], data)
            request.done_bytes = len(data)
        request.completed = True

    def close(self) -> None:
        self.closed = True
        self._sends.clear()
        self._recvs.clear()
        self._unexpected.clear()
        self.out.close()
        self.inc.close()


class Hub:
    """The process's rings: their progress, its wake-up socket, sweeping of leftovers."""

    _instance: Hub | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.links: list[Link] = []
        self.name = f"\0freescale-{os.getpid()}-{uuid.uuid4().hex[:12]}".encode()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        self.sock.bind(self.name)
        self.fd = self.sock.fileno()
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

    def remove(self, link: Link) -> None:
        with self.lock:
            if link in self.links:
                self.links.remove(link)
            link.close()

    def progress(self) -> bool:
        """Progresses every link, unless another thread is doing it right now."""
        if not self.links or not self.lock.acquire(blocking=False):
            return False
        try:
            moved = False
            for link in self.links:
                moved |= link.progress()
            return moved
        finally:
            self.lock.release()

    def drain(self) -> None:
        """Reads the wake-up bytes that arrived (the epoll sleep ended on them)."""
        with contextlib.suppress(BlockingIOError):
            for _ in range(256):
                self.sock.recv(64)

    def discard(self, link: Link, prefix: int) -> None:
        with self.lock:
            link.discard(prefix)

    def post(self, link: Link, buffer: np.ndarray, tag: int, send: bool) -> Request:
        with self.lock:
            return link.send(buffer, tag) if send else link.recv(buffer, tag)


def open_links(
    store: Any,
    rank: int,
    peers: list[int],
    slots: int,
    slot_bytes: int,
    timeout_s: float,
) -> tuple[dict[int, Link], dict[int, str]]:
    """Sets up the rings with ``peers`` (group ranks on this host) through the group's store.

    Every rank of the group calls it (with an empty list where it has no such peer). Returns
    the links, and for each peer whose link could not be made, why (both sides of a pair reach
    the same answer: a pair is used only if both sides mapped both rings).
    """
    hub = Hub.get()
    mine: dict[int, Ring] = {}
    failures: dict[int, str] = {}
    for peer in peers:
        path = hub.segment_path(f"{peer}to{rank}")
        try:
            mine[peer] = Ring(path, slots, slot_bytes, create=True)
            store.set(f"freescale/shm/{peer}to{rank}", path + "\n" + hub.name.hex())
        except OSError as err:
            with contextlib.suppress(OSError):
                os.unlink(path)
            store.set(f"freescale/shm/{peer}to{rank}", "")
            failures[peer] = f"could not create a ring in {_SHM_DIR}: {err}"
    theirs: dict[int, tuple[Ring, bytes]] = {}
    for peer in peers:
        entry = store.get(f"freescale/shm/{rank}to{peer}").decode()
        ok = False
        if entry:
            path, name = entry.split("\n")
            try:
                theirs[peer] = (Ring(path, slots, slot_bytes, create=False), bytes.fromhex(name))
                ok = True
            except (OSError, FreescaleError) as err:
                failures.setdefault(peer, f"could not map rank {peer}'s ring: {err}")
        store.set(f"freescale/shm_ok/{rank}to{peer}", "1" if ok else "0")
    links: dict[int, Link] = {}
    for peer in peers:
        peer_ok = store.get(f"freescale/shm_ok/{peer}to{rank}").decode() == "1"
        if peer_ok and peer in theirs and peer in mine:
            ring, name = theirs.pop(peer)
            links[peer] = Link(hub, ring, mine.pop(peer), name)
            hub.add(links[peer])
        else:
            failures.setdefault(peer, f"rank {peer} could not map this rank's ring")
    # Both sides of every pair have mapped (or given up on) both rings: unlink the names, so
    # that the memory goes away with the processes whatever happens to them.
    for ring in [*mine.values(), *links.values()]:
        path = ring.path if isinstance(ring, Ring) else ring.inc.path
        with contextlib.suppress(OSError):
            os.unlink(path)
    for ring in mine.values():
        ring.close()
    for ring, _ in theirs.values():
        ring.close()
    return links, failures
