"""How soon a thread that waits for a helper thread's job sees it done, by how it waits.

The job is what a reader thread does: a ``process_vm_readv`` of ``--bytes`` (GIL released),
then its future's result. The waiting thread does ``--poll-us`` of Python between checks, as a
progress pass does, and then either ``yield``-s its core (``os.sched_yield``, how a
progressing thread polls), does nothing more (``none``), calls ``time.sleep(0)`` (``sleep0``),
or sleeps in ``select`` on a socket that the job's done callback writes to, for at most 1 ms
(``select``, as the epoll sleep of ``Transport.wait_event``). Prints the median and the worst
time from the job's submission until the waiter saw it done, per mode and switch interval
(``sys.setswitchinterval``), and writes them as JSON with ``--json``.

    python benchmarks/gil_handover.py [--bytes 1M] [--poll-us 20] [--trials 40] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import socket
import statistics
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from freescale_comm._freescale_args import byte_size
from freescale_comm.shm import read_process

MODES = ("yield", "none", "sleep0", "select")
WAIT_BOUND_S = 3.0  # a trial that waits longer is cut short (and counted at this length)


def _python_for(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def _trial(mode: str, pool: ThreadPoolExecutor, job: object, poll_us: float, bell: tuple) -> float:
    ring, rung = bell
    began = time.perf_counter()
    future: Future = pool.submit(job)
    if mode == "select":
        future.add_done_callback(lambda _: rung.send(b"w"))
    while not future.done() and time.perf_counter() - began < WAIT_BOUND_S:
        _python_for(poll_us)
        if mode == "yield":
            os.sched_yield()
        elif mode == "sleep0":
            time.sleep(0)
        elif mode == "select":
            select.select([ring], [], [], 0.001)
            with contextlib.suppress(BlockingIOError):
                ring.recv(64)
    return (time.perf_counter() - began) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=byte_size, default=1 << 20)
    parser.add_argument("--poll-us", type=float, default=20.0)
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    src = np.ones(args.bytes, np.uint8)
    dst = np.ones_like(src)

    def job() -> None:
        problem = read_process(os.getpid(), dst.ctypes.data, src.ctypes.data, len(src))
        if problem is not None:
            raise OSError(problem)

    ring, rung = socket.socketpair()
    ring.setblocking(False)
    rung.setblocking(False)
    rows = []
    with ThreadPoolExecutor(2) as pool:
        for _ in range(5):
            job()
        began = time.perf_counter()
        job()
        alone_us = (time.perf_counter() - began) * 1e6
        print(f"the job on the calling thread: {alone_us:.0f} us", flush=True)
        for interval in (0.005, 0.0001):
            sys.setswitchinterval(interval)
            for mode in MODES:
                times = [
                    _trial(mode, pool, job, args.poll_us, (ring, rung)) for _ in range(args.trials)
                ]
                row = {
                    "switch_interval_s": interval,
                    "mode": mode,
                    "median_us": statistics.median(times),
                    "max_us": max(times),
                }
                rows.append(row)
                print(
                    f"switch interval {interval * 1e3:.1f} ms, {mode:7s}: seen done after "
                    f"{row['median_us']:.0f} us (median), {row['max_us']:.0f} us (worst)",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "alone_us": alone_us, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
