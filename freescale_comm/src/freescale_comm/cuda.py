"""CUDA side of the backend: copy streams, stream ordering, the pinned staging pool, watchers.

Imported only when a collective meets a CUDA tensor, so CPU-only processes never touch CUDA.
Nothing here launches a kernel: copies are contiguous byte copies (cudaMemcpyAsync: copy
engines) and ordering uses events.

- ``CopyStreams``: a collective's own D2H and H2D streams (separate, so that both PCIe
  directions run at once), created non-blocking with the driver API rather than taken from
  torch's stream pool, which hands the same 32 streams to every library of the process. A pair
  is reused only by a collective started after the previous user enqueued its last copy, so a
  later collective's wait for its caller's stream never lands in front of an earlier one's copies.
- ``StreamWatcher``: a thread per kind of event (the callers' streams, D2H, H2D) that sleeps in
  ``cudaEventSynchronize`` on the events handed to it, in order, and wakes the engine when each
  completes, so a finished copy that somebody waits for is acted on at once without polling.
  A collective's end event goes to it only where somebody waits for the collective
  (``Collective.finish_promptly``): one wake-up per collective took the GIL from the caller's
  next call.
- ``SlotPool`` over a ``_PinnedRegion``: the staged path's bounded host memory: one page-locked
  region (registered with ``cudaHostRegister``, unregistered when the group is destroyed) cut
  into chunk-sized slots, half for sends and half for receives, handed out first come, first
  served.

Why ``work.wait()`` blocks the CPU until the last message has arrived (``work.FreescaleWork``)
instead of making the caller's stream wait on a flag written by a stream memory operation
(``cuStreamWriteValue32`` / ``cuStreamWaitValue32``): that was built and run on the H200, and the
first direct collective deadlocked. The caller's default stream waited on the GPU for the flag,
while the engine thread, which writes the flag only after the data has moved, was blocked inside
UCX's ``tag_send`` of the device buffer — a CUDA call there waited for the default stream. Any
CUDA call on the progress path that synchronizes with the legacy or a blocking stream (UCX's, a
library's, a user's ``default_stream.wait_stream(side)``) closes the same cycle, and progress
here is driven by a CPU thread, not by a kernel as in NCCL. The last copies can only be enqueued
once the last message is in, so the least-blocking safe ``wait`` is: block until then, and let
the GPU wait for the copies.

The staging rings make no UCX call on the progress path, and the same flag was built for them
(``cuStreamWaitValue32`` on the caller's stream at ``wait``, ``cuStreamWriteValue32`` after the
last copies): on the H200 both ranks of the overlap benchmark hung, their engine threads inside
``cuStreamCreate`` while the callers' streams waited on flags. A stream waiting on a condition
that later copies will satisfy can stall whatever shares its hardware queue (streams are
multiplexed onto ``CUDA_DEVICE_MAX_CONNECTIONS`` queues), the driver's own work included; an
event wait is safe because its event's work is already queued. The IPC path (``ipc``) does
wait on flags, but flags that GPUs write (the peers', and its own push stream's), never a CPU
thread; its module docstring says why those waits are always met by work already queued.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import mmap
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from freescale_comm.algorithms import address
from freescale_comm.errors import FreescaleError
from freescale_comm.stream_ops import StreamOps

logger = logging.getLogger(__name__)

_CU_STREAM_NON_BLOCKING = 0x1
_MAX_SLOTS = 64  # per kind (send / receive)
_CLOSE_WAIT_S = 5.0
_MPS_ENABLED = 133  # CU_DEVICE_ATTRIBUTE_MPS_ENABLED


class IpcHandle(ctypes.Structure):
    """``CUipcMemHandle``: 64 opaque bytes naming an allocation to another process."""

    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # not c_char: its value stops at a zero


class _Driver:
    """The CUDA driver API entry points torch does not expose (through ctypes)."""

    def __init__(self, library: str = "libcuda.so.1") -> None:
        lib = ctypes.CDLL(library)

        def entry(name: str, *args: Any) -> Any:
            fn = getattr(lib, name + "_v2", None) or getattr(lib, name)
            fn.argtypes = list(args)
            fn.restype = ctypes.c_int
            return fn

        ptr, pptr = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        self.stream_create = entry("cuStreamCreate", pptr, ctypes.c_uint)
        self.stream_destroy = entry("cuStreamDestroy", ptr)
        # Unified addressing: one call copies between any two of device, pinned and pageable.
        self.memcpy_async = entry(
            "cuMemcpyAsync", ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ptr
        )
        u64, pu64, size = ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t
        # Stream memory operations: 64-bit flag writes and waits ordered in a stream (``ipc``).
        self.write_value64 = entry("cuStreamWriteValue64", ptr, u64, u64, ctypes.c_uint)
        self.wait_value64 = entry("cuStreamWaitValue64", ptr, u64, u64, ctypes.c_uint)
        self.stream_wait_event = entry("cuStreamWaitEvent", ptr, ptr, ctypes.c_uint)
        self._attribute = entry(
            "cuDeviceGetAttribute", ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int
        )
        # CUDA IPC of device memory, and what it needs: an allocation's base, plain allocations.
        self.ipc_get_mem_handle = entry("cuIpcGetMemHandle", ctypes.POINTER(IpcHandle), u64)
        self.ipc_open_mem_handle = entry("cuIpcOpenMemHandle", pu64, IpcHandle, ctypes.c_uint)
        self.ipc_close_mem_handle = entry("cuIpcCloseMemHandle", u64)
        self.mem_get_address_range = entry("cuMemGetAddressRange", pu64, ctypes.POINTER(size), u64)
        self.mem_alloc = entry("cuMemAlloc", pu64, size)
        self.mem_free = entry("cuMemFree", u64)
        self.host_get_device_pointer = entry("cuMemHostGetDevicePointer", pu64, ptr, ctypes.c_uint)
        self._device_get = entry("cuDeviceGet", ctypes.POINTER(ctypes.c_int), ctypes.c_int)
        self._device_uuid = entry(
            "cuDeviceGetUuid", ctypes.POINTER(ctypes.c_ubyte * 16), ctypes.c_int
        )
        self._primary = entry("cuDevicePrimaryCtxRetain", pptr, ctypes.c_int)
        self._get_current = entry("cuCtxGetCurrent", pptr)
        self._set_current = entry("cuCtxSetCurrent", ptr)
        self._local = threading.local()

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise FreescaleError(f"CUDA driver call {what} failed with CUresult {code}")

    def bind(self, device: int) -> ctypes.c_void_p | None:
        """Makes ``device``'s primary context current on the calling thread; returns the
        context it replaced (None if it was current already), for ``restore``.

        The driver API acts on the thread's current context, and a thread of ours may have
        none: ``torch.cuda.set_device`` skips ``cudaSetDevice`` when the index already matches
        (device 0 in a fresh thread), and not every runtime call binds the context.
        """
        contexts = self._local.__dict__.setdefault("contexts", {})
        context = contexts.get(device)
        if context is None:
            handle = ctypes.c_int()
            self.check(self._device_get(ctypes.byref(handle), device), "cuDeviceGet")
            context = ctypes.c_void_p()
            self.check(self._primary(ctypes.byref(context), handle), "cuDevicePrimaryCtxRetain")
            contexts[device] = context
        current = ctypes.c_void_p()
        self.check(self._get_current(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value == context.value:
            return None
        self.check(self._set_current(context), "cuCtxSetCurrent")
        return current

    def attribute(self, device: int, attribute: int) -> int:
        """``cuDeviceGetAttribute`` of a device ordinal."""
        handle, value = ctypes.c_int(), ctypes.c_int()
        self.check(self._device_get(ctypes.byref(handle), device), "cuDeviceGet")
        self.check(self._attribute(ctypes.byref(value), attribute, handle), "cuDeviceGetAttribute")
        return value.value

    def shared_by_mps(self, device: int) -> bool:
        """Whether this process's contexts on ``device`` are clients of an MPS server, which runs
        the work of every client at once instead of time-slicing one context at a time (False
        where the driver predates the attribute)."""
        try:
            return self.attribute(device, _MPS_ENABLED) == 1
        except FreescaleError:
            return False

    def device_uuid(self, device: int) -> bytes:
        """The GPU's UUID: processes that see it under other ordinals agree on it."""
        handle = ctypes.c_int()
        self.check(self._device_get(ctypes.byref(handle), device), "cuDeviceGet")
        uuid = (ctypes.c_ubyte * 16)()
        self.check(self._device_uuid(ctypes.byref(uuid), handle), "cuDeviceGetUuid")
        return bytes(uuid)

    def restore(self, context: ctypes.c_void_p | None) -> None:
        """Makes current again a context that ``bind`` replaced (a caller's thread keeps the
        device it had)."""
        if context is not None:
            self.check(self._set_current(context), "cuCtxSetCurrent")


_driver: _Driver | None = None
_driver_lock = threading.Lock()


def driver() -> _Driver:
    """The process's driver entry points (loaded on first use)."""
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


_streams_seen: dict[tuple[int, int, int], torch.cuda.Stream] = {}


def current_stream(device: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)`` of an initialised device, without building a
    ``Stream`` per call (5 us of a small collective's host time on the H200 machine): one per
    stream seen (a stream's id, device and type: a value, not a resource), at most 256."""
    key = torch._C._cuda_getCurrentStream(device)
    stream = _streams_seen.get(key)
    if stream is None:
        if len(_streams_seen) >= 256:
            _streams_seen.clear()
        stream = _streams_seen[key] = torch.cuda.Stream(
            stream_id=key[0], device_index=key[1], device_type=key[2]
        )
    return stream


def _new_stream(device: int) -> torch.cuda.ExternalStream:
    # Also called on a caller's thread (a collective that folds data takes its streams in
    # ``start``): that thread keeps the context it had.
    handle = ctypes.c_void_p()
    replaced = driver().bind(device)
    try:
        driver().check(
            driver().stream_create(ctypes.byref(handle), _CU_STREAM_NON_BLOCKING), "cuStreamCreate"
        )
    finally:
        driver().restore(replaced)
    return torch.cuda.ExternalStream(handle.value or 0, device=device)


def _destroy_stream(device: int, stream: torch.cuda.Stream) -> None:
    stream.synchronize()
    replaced = driver().bind(device)
    try:
        driver().stream_destroy(ctypes.c_void_p(stream.cuda_stream))
    finally:
        driver().restore(replaced)


class CopyStreams:
    """One collective's D2H and H2D streams (see the module docstring)."""

    def __init__(self, device: int) -> None:
        self._device = device
        self.d2h = _new_stream(device)
        self.h2d = _new_stream(device)

    def destroy(self) -> None:
        for stream in (self.d2h, self.h2d):
            _destroy_stream(self._device, stream)


class StreamWatcher:
    """A thread that waits for watched events in order and calls ``wake`` after each."""

    def __init__(self, name: str, device: int, wake: Callable[[], None]) -> None:
        self._queue: queue.SimpleQueue[
            tuple[torch.cuda.Event, Callable[[str | None], None] | None] | None
        ] = queue.SimpleQueue()
        self._wake = wake
        self._device = device
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(
        self, event: torch.cuda.Event, then: Callable[[str | None], None] | None = None
    ) -> None:
        """Wakes the engine once ``event`` (a blocking-sync event) has completed, after calling
        ``then`` (if given) on this thread with None, or with the CUDA error of the wait."""
        self._queue.put((event, then))

    def _run(self) -> None:
        torch.cuda.set_device(self._device)
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, then = item
            error = None
            try:
                event.synchronize()  # GIL released; the thread sleeps (blocking-sync event)
            except RuntimeError as err:  # a CUDA error: the engine's own query reports it too
                logger.exception("freescale: waiting for a CUDA event failed")
                error = f"waiting for its CUDA copies failed: {err}"
            if then is not None:
                then(error)
            self._wake()

    def close(self) -> None:
        self._queue.put(None)
        # Bounded: an event that never completes (a broken stream) must not hold the shutdown.
        self._thread.join(_CLOSE_WAIT_S)


class SlotPool:
    """Chunk-sized slots cut from one host region, half for sends and half for receives.

    Args:
        memory: the region (page-locked by ``CudaSupport``); its size is used whole.
        chunk_bytes: the staging chunk; a slot holds at least one.
    """

    def __init__(self, memory: np.ndarray, chunk_bytes: int) -> None:
        # Two of each at least: a ring needs two receive slots to move (one forwarding a chunk
        # while the next arrives).
        per_kind = min(_MAX_SLOTS, max(2, len(memory) // 2 // chunk_bytes))
        # Slots never smaller than a chunk (ring messages must fit one), and few enough that a
        # tiny chunk size does not cut the pool into millions of slots.
        slot_bytes = self.slot_bytes = max(chunk_bytes, len(memory) // 2 // per_kind)
        if len(memory) < 2 * per_kind * slot_bytes:
            raise FreescaleError(f"a staging pool of {len(memory)} bytes holds no four chunks")
        slots = [memory[i * slot_bytes : (i + 1) * slot_bytes] for i in range(2 * per_kind)]
        self._free = {"send": slots[:per_kind], "recv": slots[per_kind:]}
        # Collectives waiting for slots of each kind, in start order (first come, first served:
        # every rank starts collectives in the same order, which keeps the pipelines of all ranks
        # free of circular waits).
        self._queue: dict[str, collections.deque[object]] = {
            "send": collections.deque(),
            "recv": collections.deque(),
        }

    def enqueue(self, owner: object, kinds: Sequence[str]) -> None:
        """Puts ``owner`` in line for slots of each of ``kinds``."""
        for kind in kinds:
            self._queue[kind].append(owner)

    def take(self, owner: object, kind: str) -> np.ndarray | None:
        """A free slot of ``kind`` if ``owner`` is first in line and one is free, else None."""
        line = self._queue[kind]
        if not line or line[0] is not owner or not self._free[kind]:
            return None
        return self._free[kind].pop()

    def leave(self, owner: object, kind: str) -> None:
        """``owner`` needs no more slots of ``kind``: the next in line may take them."""
        line = self._queue[kind]
        if owner in line:
            line.remove(owner)

    def give(self, kind: str, slot: np.ndarray) -> None:
        """Returns a slot whose copies and messages have completed."""
        self._free[kind].append(slot)


class _PinnedRegion:
    """Page-locked host memory of our own: an anonymous mapping registered with CUDA (not
    torch's pinned cache, which would keep it after the group is destroyed)."""

    def __init__(self, size: int) -> None:
        self._region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.frombuffer(self._region, dtype=np.uint8)
        self._pointer = self.array.ctypes.data
        code = torch.cuda.cudart().cudaHostRegister(self._pointer, size, 0)
        if int(code) != 0:
            raise FreescaleError(f"cudaHostRegister of the {size}-byte staging pool failed: {code}")

    def close(self) -> None:
        """Unpins the region (every stream that used it has been synchronized)."""
        torch.cuda.cudart().cudaHostUnregister(self._pointer)


_HOST_REGISTER_PORTABLE_MAPPED = 0x1 | 0x2


def _register(pointer: int, size: int, what: str) -> None:
    code = torch.cuda.cudart().cudaHostRegister(pointer, size, _HOST_REGISTER_PORTABLE_MAPPED)
    if int(code) != 0:
        raise FreescaleError(f"cudaHostRegister of {what} ({size} bytes) failed: {code}")


class RingCopies:
    """Copy-in and copy-out of one staging channel (``shm.Copies``) on copy engines: the
    sender's D2H goes straight into a slot of shared page-locked memory, the receiver's H2D
    straight out of it; no host-to-host copy, no kernel. Each request's first copy waits for
    the event of its collective's caller stream; each copy records a blocking event that a
    watcher thread waits for (it wakes the engine, which then publishes or frees the slot).

    Streams and watchers are the channel's own: a channel moves its collectives' chunks in
    collective order, but channels do not wait for each other, and a later collective's wait
    for its caller's stream (which may wait for an earlier collective's end) must never sit in
    front of another channel's chunks of that earlier collective. Both rings of the channel are
    page-locked (``cudaHostRegister``) when it is attached, unregistered by ``close``.
    """

    def __init__(self, support: CudaSupport, channel: Any, wake: Callable[[], None]) -> None:
        self._support = support
        device = support.device
        self._rings = (channel.out, channel.inc)
        for ring in self._rings:
            ring.reserve()
            _register(ring.base.ctypes.data, ring.size, "a staging ring")
        self._d2h = _new_stream(device)
        self._h2d = _new_stream(device)
        self._d2h_watch = StreamWatcher("freescale-comm-ring-d2h", device, wake)
        self._h2d_watch = StreamWatcher("freescale-comm-ring-h2d", device, wake)

    def _ordered(self, stream: torch.cuda.Stream, request: Any) -> None:
        if request.ready is not None:
            stream.wait_event(request.ready)
            request.ready = None

    def copy_in(self, slot: np.ndarray, request: Any, offset: int, n: int) -> Any:
        self._ordered(self._d2h, request)
        source = request.buffer[offset : offset + n]
        return self._support.copy(self._d2h, [(slot, source)], self._d2h_watch)

    def copy_out(self, request: Any, offset: int, slot: np.ndarray) -> Any:
        self._ordered(self._h2d, request)
        target = request.buffer[offset : offset + len(slot)]
        return self._support.copy(self._h2d, [(target, slot)], self._h2d_watch)

    @staticmethod
    def done(token: Any) -> bool:
        return token.query()

    def close(self) -> None:
        """Stops the watchers, waits for the copies, unregisters the rings."""
        for watcher in (self._d2h_watch, self._h2d_watch):
            watcher.close()
        for stream in (self._d2h, self._h2d):
            _destroy_stream(self._support.device, stream)
        for ring in self._rings:
            torch.cuda.cudart().cudaHostUnregister(ring.base.ctypes.data)


class CudaSupport:
    """One group's CUDA machinery, created on its first CUDA collective.

    Args:
        device: the CUDA device of the group's tensors.
        wake: wakes the engine (``Transport.wake``); called from the watcher threads.
        pool_bytes: size of the staged path's pinned pool (allocated on first staged use).
        chunk_bytes: staging chunk size.
    """

    def __init__(
        self, device: int, wake: Callable[[], None], pool_bytes: int, chunk_bytes: int
    ) -> None:
        self.device = device
        self._pool_bytes = pool_bytes
        self._chunk_bytes = chunk_bytes
        self._pool: SlotPool | None = None
        self._region: _PinnedRegion | None = None
        self._idle: list[CopyStreams] = []
        self._all: list[CopyStreams] = []
        # Three watchers: one waiting for a caller's stream must not hold up the wake-up for a
        # finished copy of another collective, nor a D2H one an H2D one.
        self.ready_watch = StreamWatcher("freescale-comm-ready", device, wake)
        self.d2h_watch = StreamWatcher("freescale-comm-d2h", device, wake)
        self.h2d_watch = StreamWatcher("freescale-comm-h2d", device, wake)
        self._wake = wake
        self._ring_copies: dict[int, RingCopies] = {}
        self._attach_lock = threading.Lock()

    def attach(self, channel: Any) -> None:
        """Makes a staging channel copy with this device's copy engines (on its first CUDA
        message; callers' threads and the engine's post concurrently)."""
        if id(channel) in self._ring_copies:
            return
        with self._attach_lock:
            if id(channel) not in self._ring_copies:
                copies = RingCopies(self, channel, self._wake)
                channel.copies = copies
                self._ring_copies[id(channel)] = copies

    @property
    def pool(self) -> SlotPool:
        """The pinned staging pool (allocated and registered on first use)."""
        if self._pool is None:
            self._region = _PinnedRegion(self._pool_bytes)
            self._pool = SlotPool(self._region.array, self._chunk_bytes)
        return self._pool

    def streams(self) -> CopyStreams:
        """A copy stream pair no unfinished collective still enqueues copies on (callers'
        threads and the engine's take pairs concurrently: ``list.pop`` is atomic)."""
        try:
            return self._idle.pop()
        except IndexError:
            pass
        streams = CopyStreams(self.device)
        self._all.append(streams)
        return streams

    def release_streams(self, streams: CopyStreams) -> None:
        """The collective that used ``streams`` has enqueued its last copy."""
        self._idle.append(streams)

    def record_ready(self) -> torch.cuda.Event:
        """An event marking the work queued so far on the caller's current stream."""
        event = torch.cuda.Event(blocking=True)
        event.record(current_stream(self.device))
        return event

    def copy(
        self,
        stream: torch.cuda.Stream,
        pairs: Sequence[tuple[Any, Any]],
        watcher: StreamWatcher | None = None,
    ) -> torch.cuda.Event:
        """Queues the byte copy ``dst[:] = src`` for each pair on ``stream``; returns the end
        event.

        Each side is flat bytes: a numpy array (host, page-locked for an asynchronous copy) or
        a contiguous uint8 CUDA or CPU tensor. The copies go straight to the driver
        (``cuMemcpyAsync`` on the stream's handle, ``stream_ops``): a small collective queues
        several, and torch's copy through a stream context costs tens of microseconds each.
        Sources and destinations must stay alive until the event completes (the collective
        holds them). With a ``watcher``, the engine is woken when the copies complete.
        """
        ops = StreamOps()
        handle = stream.cuda_stream
        for dst, src in pairs:
            ops.copy(handle, address(dst), address(src), len(src))
        ops.run(self.device)
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        if watcher is not None:
            watcher.watch(event)
        return event

    def close(self) -> None:
        """Stops the watchers, waits for every copy stream, frees streams and the pool."""
        for watcher in (self.ready_watch, self.d2h_watch, self.h2d_watch):
            watcher.close()
        for streams in self._all:
            streams.destroy()
        for copies in self._ring_copies.values():
            copies.close()
        self._ring_copies = {}
        if self._region is not None:
            self._region.close()
            self._region = self._pool = None
