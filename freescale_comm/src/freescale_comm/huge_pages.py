"""Send buffers that peers read from this process's memory, moved onto 2 MiB pages once they
recur (``FreescaleOptions.host_huge_pages``).

A peer reads a large host message straight from the sender's memory (``shm.read_process``:
``process_vm_readv``), which looks up and references every page of the range for the copy: 512
per 2 MiB with the 4 KiB pages torch's CPU tensors get unless transparent huge pages are on for
them. Where a buffer is sent again (a training loop's, a benchmark's), this process asks the
kernel once to back the whole 2 MiB pages inside it with huge pages (``madvise(MADV_COLLAPSE)``,
Linux 6.1+: it copies each such range onto a huge page in place, whatever the system's THP
setting), so every later read walks one page-table entry per 2 MiB.

A buffer counts as recurring when a second collective sends it (the same 2 MiB-aligned range).
A collective collapses at most ``STEP_BYTES`` of it (about one copy of that: a larger tensor is
moved over several collectives). A caller's thread does it before the buffer's descriptor is
posted, so no peer reads it then; the engine thread, which progresses every group's collectives,
hands it to a short-lived thread of its own instead (a peer may then be reading it: the kernel
declines pages that a read has pinned, ``EAGAIN``, and a later collective tries again). The
content and the addresses stay as they were: only the page size behind them changes. A range
whose memory is later unmapped and mapped again at the same place (the allocator's churn) is not
collapsed a second time. Whether the kernel can collapse at all is asked once, on a mapping of
this module's own.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import mmap
import threading
from collections.abc import Callable

from freescale_comm.engine import ENGINE_THREAD

HUGE_PAGE_BYTES = 2 << 20
MADV_COLLAPSE = 25  # include/uapi/asm-generic/mman-common.h
# The most one collective collapses (about a copy of it: tens of ms on a slow host), so that a
# tensor of GiBs is moved over many collectives rather than stalling one for seconds.
STEP_BYTES = 64 << 20
# Ranges remembered, the least recently sent forgotten first, and how often a step the kernel
# declined (its pages pinned meanwhile) is tried again.
_REMEMBERED = 256
_ATTEMPTS = 3

Madvise = Callable[[int, int, int], int]  # (address, bytes, advice) -> 0 or an errno


def _libc_madvise() -> Madvise:
    libc = ctypes.CDLL(None, use_errno=True)
    call = libc.madvise
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int

    def madvise(address: int, nbytes: int, advice: int) -> int:
        return 0 if call(address, nbytes, advice) == 0 else ctypes.get_errno()

    return madvise


def _kernel_collapses(madvise: Madvise) -> bool:
    """Whether ``MADV_COLLAPSE`` works here: tried on a private anonymous mapping, touched, with
    a whole 2 MiB page inside (a kernel older than 6.1, or a process with transparent huge pages
    disabled by ``prctl``, refuses it as invalid)."""
    region = mmap.mmap(-1, 2 * HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.write(b"\1" * len(region))
        view = ctypes.c_char.from_buffer(region)
        start = ctypes.addressof(view)
        del view  # the mapping closes only once nothing points into it
        aligned = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        return madvise(aligned, HUGE_PAGE_BYTES, MADV_COLLAPSE) != errno.EINVAL
    finally:
        region.close()


class _Range:
    __slots__ = ("attempts", "done", "last_collective", "next", "sends")

    def __init__(self, low: int) -> None:
        self.last_collective = -1
        self.sends = 0  # collectives that sent it
        self.next = low  # where its collapse goes on
        self.attempts = 0  # of the step at ``next``
        self.done = False  # collapsed, or not to be tried again


class HugePages:
    """Collapses recurring send ranges onto huge pages (one per process: ``huge_pages``).

    Args:
        madvise: the system call (tests pass their own to check the policy).
        supported: whether the kernel collapses (None: asked on first use).
    """

    def __init__(self, madvise: Madvise | None = None, supported: bool | None = None) -> None:
        self._madvise = madvise
        self._supported = supported
        self._lock = threading.Lock()
        self._ranges: collections.OrderedDict[tuple[int, int], _Range] = collections.OrderedDict()
        self._queued: collections.deque[tuple[_Range, int, int, int]] = collections.deque()
        self._worker: threading.Thread | None = None
        self._collapsed = 0
        self._refusals: collections.Counter[str] = collections.Counter()

    @property
    def collapsed(self) -> int:
        """Ranges this process has collapsed whole."""
        return self._collapsed

    @property
    def refusals(self) -> dict[str, int]:
        """How often the kernel declined a step, by its error's name (``ENOMEM``: no huge
        page free, or none the memory cgroup allows; ``EAGAIN``: pages pinned by a reader)."""
        with self._lock:
            return dict(self._refusals)

    def supported(self) -> bool:
        """Whether this kernel collapses ranges onto huge pages (asked once)."""
        if self._madvise is None:
            self._madvise = _libc_madvise()
        if self._supported is None:
            self._supported = _kernel_collapses(self._madvise)
        return self._supported

    def sending(self, address: int, nbytes: int, collective: int) -> None:
        """Notes that ``collective`` sends ``nbytes`` at ``address`` for a peer to read; from
        the second collective that does, collapses the huge pages inside them, at most
        ``STEP_BYTES`` per collective (a step the kernel declined is tried again, up to
        ``_ATTEMPTS`` times): here, or on a thread of its own where this is the engine thread."""
        low = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        high = (address + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if high <= low or self._supported is False:
            return
        with self._lock:
            key = (low, high)
            found = self._ranges.pop(key, None) or _Range(low)
            self._ranges[key] = found
            if len(self._ranges) > _REMEMBERED:
                self._ranges.popitem(last=False)
            if found.done or found.last_collective == collective:
                return  # one count per collective: an AllGather sends its input to every peer
            found.last_collective = collective
            found.sends += 1
            if found.sends < 2:
                return
            found.attempts += 1
            step = (found, found.next, min(high, found.next + STEP_BYTES), high)
            if threading.current_thread().name == ENGINE_THREAD:
                self._queued.append(step)
                if self._worker is None:
                    self._worker = threading.Thread(
                        target=self._drain, name="freescale-comm-huge-pages", daemon=True
                    )
                    self._worker.start()
                return
        self._collapse(*step)

    def _drain(self) -> None:
        """The worker: collapses the queued steps, then ends."""
        while True:
            with self._lock:
                if not self._queued:
                    self._worker = None
                    return
                step = self._queued.popleft()
            self._collapse(*step)

    def _collapse(self, found: _Range, low: int, high: int, end: int) -> None:
        if not self.supported():
            return
        assert self._madvise is not None
        failure = self._madvise(low, high - low, MADV_COLLAPSE)
        with self._lock:
            if failure == 0:
                found.next, found.attempts = high, 0
                found.done = high == end
                self._collapsed += found.done
                return
            self._refusals[errno.errorcode.get(failure, str(failure))] += 1
            if failure != errno.EAGAIN or found.attempts >= _ATTEMPTS:
                # EINVAL: memory that cannot be collapsed (a shared mapping not 2 MiB-aligned);
                # ENOMEM / EBUSY: no huge page free, or none its memory cgroup allows;
                # EAGAIN: pinned by a reader each time.
                found.done = True


huge_pages = HugePages()
