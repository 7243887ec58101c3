"""The floor of a 4-rank CPU AllToAll by reads of the peers' memory on this host, without the
backend: 4 processes, each reads SIZE/4 bytes from each of the 3 others (``process_vm_readv``,
the backend's own ``read_process``) and copies its own SIZE/4, all at once between two
barriers. Per size and page size (4 KiB, or ``MADV_HUGEPAGE``): the slowest rank's median time
per round over 40 rounds.

    python benchmarks/results/comm_cpu/bench_fast_gloo_host/read_floor.py
"""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np

from freescale_comm.shm import read_process

RANKS = 4
ROUNDS = 40
_PR_SET_PTRACER = 0x59616D61  # let the peers read this process (Yama)


def _rank(rank: int, size: int, huge: bool, conn: Any, barrier: Any, out: Any) -> None:
    ctypes.CDLL(None).prctl(_PR_SET_PTRACER, ctypes.c_ulong((1 << 64) - 1), 0, 0, 0)
    source, target = mmap.mmap(-1, size), mmap.mmap(-1, size)
    if huge:
        source.madvise(mmap.MADV_HUGEPAGE)
        target.madvise(mmap.MADV_HUGEPAGE)
    sent = np.frombuffer(source, dtype=np.uint8)
    received = np.frombuffer(target, dtype=np.uint8)
    sent[:] = rank + 1
    received[:] = 0  # touched: as the backend's reused outputs are
    into = ctypes.addressof(ctypes.c_char.from_buffer(target))
    conn.send((os.getpid(), ctypes.addressof(ctypes.c_char.from_buffer(source))))
    peers = conn.recv()
    piece = size // RANKS
    times = []
    for _ in range(ROUNDS):
        barrier.wait()
        start = time.perf_counter()
        for step in range(1, RANKS):
            peer = (rank + step) % RANKS
            pid, address = peers[peer]
            error = read_process(pid, into + peer * piece, address + rank * piece, piece)
            assert error is None, error
        received[rank * piece : (rank + 1) * piece] = sent[rank * piece : (rank + 1) * piece]
        barrier.wait()
        times.append(time.perf_counter() - start)
    out.put(statistics.median(times))


def main() -> None:
    for size in (1 << 20, 4 << 20, 16 << 20):
        for huge in (False, True):
            barrier, out = mp.Barrier(RANKS), mp.Queue()
            pipes = [mp.Pipe() for _ in range(RANKS)]
            ranks = [
                mp.Process(target=_rank, args=(r, size, huge, pipes[r][1], barrier, out))
                for r in range(RANKS)
            ]
            for process in ranks:
                process.start()
            peers = [pipes[r][0].recv() for r in range(RANKS)]
            for r in range(RANKS):
                pipes[r][0].send(peers)
            slowest = max(out.get(timeout=120) for _ in range(RANKS))
            for process in ranks:
                process.join(30)
            pages = "huge" if huge else "4 KiB"
            print(f"{size >> 20:3d} MiB per rank, {pages} pages: {slowest * 1e6:.0f} us per round")


if __name__ == "__main__":
    main()
