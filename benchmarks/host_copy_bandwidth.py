"""How fast this machine copies host memory: the bound of large CPU collectives on few cores.

1. ``process_vm_readv`` (what ``freescale_comm`` reads a large message with) from another
   process into this one, one core: median GB/s of 30 reads per size.
2. Reads (``process_vm_readv``, each of a process of its own) and plain copies of
   ``--copy-mib`` (beyond the cache) in 1, 2 and 4 processes at once for 2 s each: the
   machine's aggregate rates, which ranks sharing its cores split.

    python benchmarks/host_copy_bandwidth.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.synchronize import Barrier as BarrierType
from multiprocessing.synchronize import Event as EventType
from typing import Any

import numpy as np

from freescale_comm.shm import read_process

MIB = 1 << 20
READS = 30
COPY_S = 2.0


def _read_all(pid: int, local: int, remote: int, size: int) -> None:
    """``read_process``, raising where it fails."""
    failed = read_process(pid, local, remote, size)
    if failed is not None:
        raise RuntimeError(f"process_vm_readv failed: {failed}")


def _hold(size: int, addresses: mp.Queue, release: EventType) -> None:
    """Holds ``size`` bytes for another process to read, and sends its pid and their address."""
    source = np.ones(size, dtype=np.uint8)
    addresses.put((os.getpid(), source.ctypes.data))
    release.wait(60)


def _read_rate(size: int) -> float:
    """GB/s of ``process_vm_readv`` of ``size`` bytes from a child process, median of reads."""
    addresses, release = mp.Queue(), mp.Event()
    holder = mp.Process(target=_hold, args=(size, addresses, release), daemon=True)
    holder.start()
    try:
        _, remote = addresses.get(timeout=30)
        local = np.empty(size, dtype=np.uint8)
        times = []
        for _ in range(READS + 1):  # the first faults the pages in
            began = time.perf_counter()
            _read_all(holder.pid, local.ctypes.data, remote, size)
            times.append(time.perf_counter() - began)
        return size / statistics.median(times[1:]) / 1e9
    finally:
        release.set()
        holder.join(10)


def _repeat(step: Callable[[], None], size: int, start: BarrierType, rates: mp.Queue) -> None:
    """Runs ``step``, which moves ``size`` bytes, over and over for ``COPY_S`` once every
    worker is ready, and sends its GB/s."""
    step()  # pages touched before the clock starts
    start.wait(60)
    steps, began = 0, time.perf_counter()
    while time.perf_counter() - began < COPY_S:
        step()
        steps += 1
    rates.put(steps * size / (time.perf_counter() - began) / 1e9)


def _at_once(worker: Callable[..., None], arguments: list[tuple[Any, ...]]) -> float:
    """Runs one ``worker(*args, start, rates)`` process per entry at once; their GB/s summed."""
    start, rates = mp.Barrier(len(arguments)), mp.Queue()
    workers = [mp.Process(target=worker, args=(*args, start, rates)) for args in arguments]
    for process in workers:
        process.start()
    total = sum(rates.get(timeout=60) for _ in workers)
    for process in workers:
        process.join(10)
    return total


def _read(pid: int, remote: int, size: int, start: BarrierType, rates: mp.Queue) -> None:
    """Reads ``size`` bytes of process ``pid`` at ``remote`` (``_repeat``)."""
    local = np.empty(size, dtype=np.uint8)
    _repeat(lambda: _read_all(pid, local.ctypes.data, remote, size), size, start, rates)


def _copy(size: int, start: BarrierType, rates: mp.Queue) -> None:
    """Copies ``size`` bytes within this process (``_repeat``)."""
    source = np.ones(size, dtype=np.uint8)
    target = np.empty_like(source)
    _repeat(lambda: np.copyto(target, source), size, start, rates)


def _aggregate_read_rate(size: int, processes: int) -> float:
    """GB/s of ``processes`` readers at once, each reading ``size`` bytes of a holder of its
    own with ``process_vm_readv``, summed."""
    addresses, release = mp.Queue(), mp.Event()
    holders = [
        mp.Process(target=_hold, args=(size, addresses, release), daemon=True)
        for _ in range(processes)
    ]
    for holder in holders:
        holder.start()
    try:
        sources = [addresses.get(timeout=30) for _ in holders]
        return _at_once(_read, [(pid, remote, size) for pid, remote in sources])
    finally:
        release.set()
        for holder in holders:
            holder.join(10)


def _aggregate_copy_rate(size: int, processes: int) -> float:
    """GB/s of ``processes`` processes copying ``size`` bytes each at once, summed."""
    return _at_once(_copy, [(size,)] * processes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--read-mib", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--copy-mib", type=int, default=64)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "load_avg_1m_at_start": os.getloadavg()[0],
        "read_gbps": {mib: round(_read_rate(mib * MIB), 1) for mib in args.read_mib},
        "copy_mib": args.copy_mib,
        "aggregate_read_gbps": {
            n: round(_aggregate_read_rate(args.copy_mib * MIB, n), 1) for n in (1, 2, 4)
        },
        "aggregate_copy_gbps": {
            n: round(_aggregate_copy_rate(args.copy_mib * MIB, n), 1) for n in (1, 2, 4)
        },
    }
    report["load_avg_1m_at_end"] = os.getloadavg()[0]
    for mib, rate in report["read_gbps"].items():
        print(f"process_vm_readv of {mib} MiB, one core: {rate} GB/s")
    for n, rate in report["aggregate_read_gbps"].items():
        print(f"process_vm_readv of {args.copy_mib} MiB in {n} processes at once: {rate} GB/s")
    for n, rate in report["aggregate_copy_gbps"].items():
        print(f"copies of {args.copy_mib} MiB in {n} processes at once: {rate} GB/s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
