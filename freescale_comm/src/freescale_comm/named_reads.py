"""Reads named in headers: a CPU collective's large pieces between ranks of one host, read by
their receiver from the sender's memory at the addresses the sender's header names.

A collective's header reaches each peer of its host through the sender's outbox (``outbox``).
Where a piece for that peer is one its receiver reads from the sender's memory
(``GroupContext.reads_named``: above the rings' limit, in a direction the kernel allows), the
header carries the piece's address after the signature. A receiver that has judged the headers
consistent reads its peers' pieces at once (``shm.read_process``; on its reader threads where
it has them, unless a call alone in flight reads ``local_copies.INLINE_READ_BYTES`` or less in
all)
and releases their outboxes of the collective only once they are read, so a
reader's ``consumed`` counter reaching the collective tells the sender its pieces are read;
the sender's collective completes once every reader's has (``Outboxes.reads_done``). That is
two rounds between the ranks per collective, the headers and the reads' end, and no message;
read descriptors sent through the rings after the verdict cost a third round and a ring
message per piece (4 ranks on 2 cores: AllToAll of 4 MiB 0.92 ms against 1.24,
``benchmarks/results/comm_cpu/named_reads/``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from freescale_comm import shm
from freescale_comm.local_copies import start_reads

_ADDRESS_BYTES = 8


def addresses(buffers: Sequence[np.ndarray]) -> np.ndarray:
    """The header part that names where ``buffers`` lie in this process: one u64 each."""
    return np.array([b.ctypes.data for b in buffers], dtype=np.uint64).view(np.uint8)


def decode(header: np.ndarray, offset: int, count: int) -> list[int] | None:
    """The ``count`` addresses a peer's header names from byte ``offset`` on, or None if the
    header is too short for them."""
    part = header[offset : offset + count * _ADDRESS_BYTES]
    if len(part) != count * _ADDRESS_BYTES:
        return None
    return np.frombuffer(part.tobytes(), dtype=np.uint64).tolist()


class PendingReads:
    """One collective's reads of its peers' pieces, started at once: on this thread, one after
    another (one reader thread), or split over the process's reader threads
    (``local_copies.start_reads``, the last part here).

    Args:
        reads: (the peer, its channel, its address of the piece, the receive buffer) per
            piece.
        threads: the rank's reader threads (``host_copy_threads``).
        wake: ends the progressing thread's sleep as each part on a reader thread ends.
    """

    def __init__(
        self,
        reads: Sequence[tuple[int, Any, int, np.ndarray]],
        threads: int,
        wake: Callable[[], None],
    ) -> None:
        self._reads = reads
        jobs = [_job(channel.peer_pid, remote, buffer) for _, channel, remote, buffer in reads]
        lengths = [len(buffer) for *_, buffer in reads]
        # Why each read failed (None: it did not), once all have ended; else their parts.
        self._failures: list[str | None] | None = None
        self._parts: list[list[Future[str | None]]] = []
        if threads < 2:
            self._failures = [_run(job, n) for job, n in zip(jobs, lengths, strict=True)]
            self._count([1] * len(reads))
        else:
            sized = [(job, n, threads) for job, n in zip(jobs, lengths, strict=True)]
            self._parts = start_reads(sized, wake)

    def done(self) -> bool:
        if self._failures is None:
            if not all(part.done() for parts in self._parts for part in parts):
                return False
            self._failures = [shm.read_failure(parts) for parts in self._parts]
            self._count([len(parts) for parts in self._parts])
        return True

    def wait(self) -> None:
        """Blocks until every part has ended, whatever its outcome (bounded: a copy)."""
        for parts in self._parts:
            for part in parts:
                part.exception()

    def failure(self) -> str | None:
        """Why a read failed (``done`` holds), or None."""
        for (peer, channel, _, buffer), failed in zip(self._reads, self._failures, strict=True):
            if failed is not None:
                return (
                    f"reading {len(buffer)} bytes from rank {peer} (process {channel.peer_pid}) "
                    f"failed: {failed} (has it exited?)"
                )
        return None

    def _count(self, parts: list[int]) -> None:
        """Counts the reads in their channels (``freescale comm info``, tests)."""
        for (_, channel, _, _), count in zip(self._reads, parts, strict=True):
            channel.reads += 1
            channel.split_reads += count > 1


def _run(job: Callable[[int, int], str | None], nbytes: int) -> str | None:
    """``job`` over [0, ``nbytes``) here: why it failed, or None."""
    try:
        return job(0, nbytes)
    except Exception as err:  # as a reader thread's would: the collective fails with it
        return f"{type(err).__name__}: {err}"


def _job(pid: int, remote: int, buffer: np.ndarray) -> Callable[[int, int], str | None]:
    local = buffer.ctypes.data
    return lambda a, b: shm.read_process(pid, local + a, remote + a, b - a)
