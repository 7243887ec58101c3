"""Cross-memory attach: one copy from a peer process's memory into this one's.

Linux's ``process_vm_readv`` copies straight from another process's address space, the kernel
walking both sides' pages: between the ranks of one host a CPU piece then moves with one copy,
made by its receiver, instead of two through shared memory (the outbox's copy in and copy out).
The call runs without the GIL (``ctypes``). It needs the right to trace the peer (same user,
and Yama's ``ptrace_scope`` at most 1 for a parent-child pair, 0 otherwise), which a group
probes at set-up (``probe``) before it relies on it.
"""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np

from freescale_comm.errors import FreescaleError

_readv = None
if sys.platform.startswith("linux"):
    _readv = ctypes.CDLL(None, use_errno=True).process_vm_readv
    _readv.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    _readv.restype = ctypes.c_ssize_t


def read(pid: int, destination: np.ndarray, address: int) -> None:
    """Copies ``len(destination)`` bytes at ``address`` in process ``pid`` into
    ``destination`` (contiguous); raises ``FreescaleError`` naming the OS's reason."""
    if _readv is None:
        raise FreescaleError("cross-memory attach needs Linux")
    # One iovec each side, {base, length} as two u64 (x86-64 and aarch64 Linux).
    iov = np.empty(4, dtype=np.uint64)
    iov_at = iov.ctypes.data
    done, total, base = 0, len(destination), destination.ctypes.data
    while done < total:  # the kernel stops at about 2 GiB per call
        iov[:] = (base + done, total - done, address + done, total - done)
        got = _readv(pid, iov_at, 1, iov_at + 16, 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            why = os.strerror(err) if got < 0 else "no bytes"
            raise FreescaleError(f"reading process {pid}'s memory failed: {why}")
        done += got


def probe(pid: int, address: int, expected: bytes) -> str | None:
    """None if this process can read ``expected`` at ``address`` in process ``pid``, else
    why not."""
    if _readv is None:
        return "cross-memory attach needs Linux"
    seen = np.zeros(len(expected), dtype=np.uint8)
    try:
        read(pid, seen, address)
    except FreescaleError as err:
        return str(err)
    if seen.tobytes() != expected:
        return f"process {pid}'s memory read back wrong"
    return None
