"""The CUDA IPC path between ranks of one host: copy-engine pulls, ordered on the GPU by flags.

Every rank of a collective tells each peer, in its validation header, where the bytes meant for
that peer lie: a CUDA IPC handle of the allocation and an offset (``Descriptor``). Once a rank
has judged the headers consistent it queues the whole collective on the group's IPC stream and
returns; no CPU thread waits for the GPU, and the data moves without a kernel:

1. wait for the caller's stream (the inputs are produced, the outputs free);
2. per peer, a flag write "my inputs of collective ``seq`` are ready" into the pair's shared
   page (``cuStreamWriteValue32``);
3. the rank's own piece, a local device-to-device copy;
4. per peer, in ring order: wait for its ready flag (``cuStreamWaitValue32``), copy its pieces
   straight from its memory (mapped once per allocation, ``cuIpcOpenMemHandle``) into the
   outputs with ``cudaMemcpyAsync`` (copy engines; over NVLink or PCIe between GPUs), then write
   "I have read yours" into the pair's page;
5. wait for every peer's "I have read yours": only then may the caller reuse its inputs;
6. the end event, which ``work.wait()`` makes the caller's stream wait for.

Flags live in the first page of the pair's host rings (``shm``), page-locked and mapped for the
GPU in both processes: each rank writes only the flags of its outgoing ring and waits only on
those of its incoming one, and both only grow (the collective's sequence number, compared
cyclically), so they are never reset. The CPU never writes them, except to release waits when
the group is aborted (by a failed collective, or by the liveness poll that finds a silent peer
or the abort key): a dead peer's flags would otherwise hold the streams forever.

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
would meet it, cannot run, so there each collective is queued only once the previous one has
finished (measured on one H200 shared by 2 ranks: 4.4 ms per back-to-back 8-byte AllToAll
without this, 1.3 ms with it).

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
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from freescale_comm.shm import Link

logger = logging.getLogger(__name__)

_ENTRY = struct.Struct("<64sQQ")  # handle, offset in the allocation, bytes
_COUNT = struct.Struct("<16sQ")  # the sender's GPU (UUID), pieces
_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*flag - value) >= 0
_WRITE_DEFAULT = 0x0  # with a memory barrier: earlier copies are visible first
_LAZY_PEER_ACCESS = 0x1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_FLAG_PAGE = 4096
_READY, _DONE = 16, 24  # uint64 indices in a ring's control block (``shm._CTRL_BYTES``)
_RELEASE = 1 << 30  # abort: flags set this far ahead let every queued wait pass
_MAPS_PER_PEER = 64


def pieces_in(room: int) -> int:
    """How many pieces a descriptor of at most ``room`` bytes can name."""
    return max(0, (room - _COUNT.size) // _ENTRY.size)


@dataclass(frozen=True)
class Piece:
    """Where a peer's bytes for this rank lie: an allocation (its IPC handle), offset, size."""

    handle: bytes
    offset: int
    nbytes: int


def encode(gpu: bytes, pieces: Sequence[tuple[bytes, int, int]]) -> np.ndarray:
    """A descriptor: the sender's GPU, then per piece (handle, offset, bytes) in message order."""
    data = _COUNT.pack(gpu, len(pieces)) + b"".join(_ENTRY.pack(*p) for p in pieces)
    return np.frombuffer(data, dtype=np.uint8)


def decode(message: np.ndarray, pieces: int) -> tuple[bytes, list[Piece]]:
    """The sender's GPU and the pieces of a descriptor (at the start of ``message``), which
    must name ``pieces`` of them."""
    gpu, count = _COUNT.unpack(message[: _COUNT.size].tobytes())
    end = _COUNT.size + count * _ENTRY.size
    if count != pieces or len(message) < end:
        raise FreescaleError(f"a CUDA IPC descriptor names {count} pieces, {pieces} expected")
    raw = message[_COUNT.size : end].tobytes()
    return gpu, [Piece(*entry) for entry in _ENTRY.iter_unpack(raw)]


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
    """This rank's side of one IPC collective: the descriptor for each peer, and the copies into
    scratch that its memory IPC cannot export needs (queued before the ready flags).

    Args:
        path: the group's IPC path (its scratch allocation).
        sends: per peer, the send buffers meant for it, in message order.
    """

    def __init__(self, path: IpcPath, sends: dict[int, list[Any]]) -> None:
        self.scratch_copies: list[tuple[int, Any]] = []  # (scratch offset, source bytes)
        cu = driver()
        replaced = cu.bind(path.device)
        try:
            entries = self._locate(sends)
        finally:
            cu.restore(replaced)
        if self.scratch_copies:
            offset, last = self.scratch_copies[-1]
            path.scratch.fit(offset + len(last))
        # The allocation the descriptors name: a later collective may replace the scratch
        # before this one is queued (replaced ones live as long as the group).
        self.scratch_pointer = path.scratch.pointer
        self._gpu = path.gpu
        self._descriptors = {
            peer: encode(
                self._gpu, [(h if h is not None else path.scratch.handle, o, n) for h, o, n in e]
            )
            for peer, e in entries.items()
        }

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
        return found if found is not None else encode(self._gpu, [])


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
        cu = driver()
        value = IpcHandle.from_buffer_copy(handle)
        mapped_at = ctypes.c_uint64()
        code = cu.ipc_open_mem_handle(ctypes.byref(mapped_at), value, _LAZY_PEER_ACCESS)
        if code != 0:
            raise FreescaleError(
                f"cuIpcOpenMemHandle of a peer's memory failed with CUresult {code} (processes "
                "in separate containers, or GPUs without peer access?); cuda_path='staged' avoids "
                "CUDA IPC"
            )
        self._maps[handle] = mapped_at.value
        return mapped_at.value

    def close(self) -> None:
        cu = driver()
        for mapped in self._maps.values():
            cu.ipc_close_mem_handle(mapped)
        self._maps.clear()


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

    def release(self, seq: int) -> None:
        """Sets every flag of the pair far past ``seq`` (CPU stores): queued waits pass."""
        value = (seq + _RELEASE) & 0xFFFFFFFF
        for ring in self._rings:
            if ring.ctrl is not None:
                ring.ctrl[_READY] = value
                ring.ctrl[_DONE] = value

    def close(self) -> None:
        for page in self._pages:
            torch.cuda.cudart().cudaHostUnregister(page)
        self._pages = []


class IpcPath:
    """One group's IPC machinery on one device: its stream, the pairs' flags, mapped peer
    memory, the scratch allocation. Made on the group's first IPC collective.

    Args:
        device: the CUDA device of the group's tensors.
        links: the shared-memory links with the peers on this host, by group rank.
    """

    def __init__(self, device: int, links: dict[int, Link]) -> None:
        self.device = device
        self._maps: dict[int, _PeerMaps] = collections.defaultdict(_PeerMaps)
        self.scratch = _Scratch(device)
        self.gpu = driver().device_uuid(device)
        self._last_seq = 0
        # IPC collectives started (``start``, call order) and not yet queued: queued in
        # sequence order, so that flags grow in stream order on every rank.
        self._unqueued: set[int] = set()
        # A peer on this same GPU (time-sliced contexts): a queued wait for it spins through
        # this context's time slice while the peer's context, which would meet it, cannot run;
        # collectives are then queued one at a time (``ready``).
        self.shares_gpu = False
        self._last_final: torch.cuda.Event | None = None
        # One stream for every IPC collective of the group: collectives run in call order,
        # each one's flag writes before its waits (see the module docstring).
        self.stream = _new_stream(device)
        # Page-locked now, before any wait is queued: registering memory may wait for the GPU.
        self._flags: dict[int, _Flags] = {}
        try:
            for peer, link in links.items():
                self._flags[peer] = _Flags(link)
        except FreescaleError:
            self.close()
            raise

    def started(self, seq: int) -> None:
        """Collective ``seq`` takes this path (called in call order)."""
        self._unqueued.add(seq)

    def ready(self, seq: int) -> bool:
        """Whether collective ``seq`` may be queued now: every earlier one is (or gave up),
        and on a GPU shared with a peer the previous one has finished."""
        if min(self._unqueued) != seq:
            return False
        return not self.shares_gpu or self._last_final is None or self._last_final.query()

    def done_with(self, seq: int, final: torch.cuda.Event | None) -> None:
        """Collective ``seq`` is queued (ending with ``final``) or failed before that."""
        self._unqueued.discard(seq)
        if final is not None:
            self._last_final = final

    def enqueue(
        self,
        seq: int,
        ready: torch.cuda.Event,
        export: Export,
        readers: Sequence[int],
        pulls: dict[int, list[tuple[Any, Piece]]],
        local_copies: Sequence[tuple[Any, Any]],
    ) -> None:
        """Queues one collective (steps 1-5 of the module docstring) on the IPC stream.

        Args:
            seq: the collective's sequence number in the group (the same on every rank).
            ready: the event of the caller's stream at the call.
            export: this rank's side (scratch copies to make first).
            readers: the peers that pull from this rank.
            pulls: per peer this rank pulls from, in the order to visit them: (destination
                bytes, where they lie).
            local_copies: (destination, source) bytes of this rank's own piece.
        """
        cu = driver()
        replaced = cu.bind(self.device)
        try:
            stream = self.stream
            # Peers' new allocations mapped first: mapping may wait for the GPU (it took until
            # the queued matmuls were done in one measurement), and must never wait while a
            # part of this collective that a peer's queued waits need is still unqueued.
            sources = {}
            for peer, pieces in pulls.items():
                maps, keep = self._maps[peer], {p.handle for _, p in pieces}
                sources[peer] = [
                    (address(dst), maps.pointer(p.handle, stream, keep) + p.offset, p.nbytes)
                    for dst, p in pieces
                ]
            handle = ctypes.c_void_p(stream.cuda_stream)
            stream.wait_event(ready)
            flag = seq & 0xFFFFFFFF
            self._last_seq = seq
            for offset, source in export.scratch_copies:
                _copy(cu, export.scratch_pointer + offset, address(source), len(source), handle)
            for peer in readers:
                _write(cu, handle, self._flags[peer].my_ready, flag)
            for dst, src in local_copies:
                _copy(cu, address(dst), address(src), len(src), handle)
            for peer, copies in sources.items():
                flags = self._flags[peer]
                _wait(cu, handle, flags.peer_ready, flag)
                for dst, src, nbytes in copies:
                    _copy(cu, dst, src, nbytes, handle)
                _write(cu, handle, flags.my_done, flag)
            for peer in readers:
                _wait(cu, handle, self._flags[peer].peer_done, flag)
        finally:
            cu.restore(replaced)

    def release(self) -> None:
        """Lets every queued wait of the group pass (the group was aborted)."""
        for flags in self._flags.values():
            flags.release(self._last_seq)

    def close(self) -> None:
        """Waits for the stream, then unmaps and frees. Waits still queued after
        ``_CLOSE_WAIT_S`` (the group destroyed in the middle of a collective) are released, again
        and again for as long once more (a peer's late flag write can undo a release); a stream
        that still does not drain keeps its memory (logged) rather than hang the shutdown."""
        start = time.monotonic()
        while not self.stream.query():
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
            for maps in self._maps.values():
                maps.close()
            for flags in self._flags.values():
                flags.close()
            self.scratch.close()
        finally:
            cu.restore(replaced)


def _copy(cu: Any, dst: int, src: int, nbytes: int, stream: ctypes.c_void_p) -> None:
    if nbytes:
        cu.check(cu.memcpy_async(dst, src, nbytes, stream), "cuMemcpyAsync")


def _write(cu: Any, stream: ctypes.c_void_p, flag: int, value: int) -> None:
    cu.check(cu.write_value32(stream, flag, value, _WRITE_DEFAULT), "cuStreamWriteValue32")


def _wait(cu: Any, stream: ctypes.c_void_p, flag: int, value: int) -> None:
    cu.check(cu.wait_value32(stream, flag, value, _WAIT_GEQ), "cuStreamWaitValue32")
