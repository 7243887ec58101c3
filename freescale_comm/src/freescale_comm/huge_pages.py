"""Send buffers that peers read from this process's memory, moved onto 2 MiB pages once they
recur (``FreescaleOptions.host_huge_pages``).

A peer reads a large host message straight from the sender's memory (``shm.read_process``:
``process_vm_readv``), which pins every page of the range for the copy: 512 pages per 2 MiB with
the 4 KiB pages torch's CPU tensors get unless transparent huge pages are on for them. Where a
buffer is sent again (a training loop's, a benchmark's), this process asks the kernel once to
back the whole 2 MiB pages inside it with huge pages (``madvise(MADV_COLLAPSE)``, Linux 6.1+:
it copies each such range onto a huge page in place, whatever the system's THP setting), so
every later read pins one page per 2 MiB and walks fewer page tables.

A buffer counts as recurring when a second collective sends it (the same 2 MiB-aligned range).
The collapse runs in the sending thread before the buffer's descriptor is posted, so no peer
reads it then; one that still reads it for an earlier collective keeps its pages pinned, and the
kernel then declines (``EAGAIN``), which a later collective retries. The content and the
addresses stay as they were: only the page size behind them changes. A collapse costs about one
copy of the range, once, and a collective collapses at most ``STEP_BYTES`` (a larger tensor is
moved over several); a range whose memory is later unmapped and mapped again at the same place
(the allocator's churn) is not collapsed a second time.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import threading
from collections.abc import Callable

HUGE_PAGE_BYTES = 2 << 20
MADV_COLLAPSE = 25  # include/uapi/asm-generic/mman-common.h
# The most one collective collapses (about a copy of it: tens of ms on a slow host), so that a
# tensor of GiBs is moved over many collectives rather than stalling one for seconds.
STEP_BYTES = 64 << 20
# Ranges remembered, the least recently sent forgotten first, and how often a step the kernel
# declined (its pages pinned meanwhile) is tried again.
_REMEMBERED = 256
_ATTEMPTS = 3
# Where every collapse so far was refused as invalid, the kernel lacks MADV_COLLAPSE (older than
# 6.1): stop asking after this many.
_INVALID_BEFORE_OFF = 4

Madvise = Callable[[int, int, int], int]  # (address, bytes, advice) -> 0 or an errno


def _libc_madvise() -> Madvise:
    libc = ctypes.CDLL(None, use_errno=True)
    call = libc.madvise
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int

    def madvise(address: int, nbytes: int, advice: int) -> int:
        return 0 if call(address, nbytes, advice) == 0 else ctypes.get_errno()

    return madvise


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
    """

    def __init__(self, madvise: Madvise | None = None) -> None:
        self._madvise = madvise
        self._lock = threading.Lock()
        self._ranges: collections.OrderedDict[tuple[int, int], _Range] = collections.OrderedDict()
        self._collapsed = 0
        self._invalid = 0
        self.off = False  # the kernel has no MADV_COLLAPSE

    @property
    def collapsed(self) -> int:
        """Ranges this process has collapsed whole."""
        return self._collapsed

    def sending(self, address: int, nbytes: int, collective: int) -> None:
        """Notes that ``collective`` sends ``nbytes`` at ``address`` for a peer to read; from
        the second collective that does, collapses the huge pages inside them, at most
        ``STEP_BYTES`` per collective (a step the kernel declined is tried again, up to
        ``_ATTEMPTS`` times)."""
        low = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        high = (address + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if high <= low or self.off:
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
            step_low = found.next
            step_high = min(high, step_low + STEP_BYTES)
        if self._madvise is None:
            self._madvise = _libc_madvise()
        failure = self._madvise(step_low, step_high - step_low, MADV_COLLAPSE)
        with self._lock:
            if failure == 0:
                found.next, found.attempts = step_high, 0
                found.done = step_high == high
                self._collapsed += found.done
            elif failure == errno.EINVAL:
                found.done = True  # not anonymous memory, or no MADV_COLLAPSE at all
                self._invalid += 1
                self.off = self._collapsed == 0 and self._invalid >= _INVALID_BEFORE_OFF
            elif failure != errno.EAGAIN or found.attempts >= _ATTEMPTS:
                found.done = True  # ENOMEM: no huge page free; EAGAIN: pinned each time


huge_pages = HugePages()
