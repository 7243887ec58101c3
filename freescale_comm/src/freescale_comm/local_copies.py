"""Helper threads where the host has cores to spare: a CPU collective's own host pieces (its local
copies), and reads of the senders' memory (``shm.Channel``).

On a host whose cores outnumber its ranks one thread copies memory far slower than the host can:
on the 16-vCPU GPU machine a 64 MiB copy ran at 4.0–4.9 GB/s on one thread and at 25–31 GB/s
split over 8, also with two processes copying at once
(``benchmarks/results/comm_cpu/many_core_host/``). The thread that progresses a CPU collective
also moves its messages through the rings; while it copied the rank's own piece, no message
moved. Here that copy is split over helper threads (numpy releases the GIL while it copies) and
the progressing thread moves the messages meanwhile; the collective completes once both are
done, and each helper wakes it as it finishes (``Transport.wake``). Where each rank has fewer
than two cores (the 2-core CI machine with 2 ranks) the copies stay on the progressing thread
(``host_copy``), which measured fastest there. Reads of peers' messages out of their memory
run on reader threads too, as many at once as the rank has helpers (``start_reads``: the
messages of several peers at once, a large one split between them), and where every rank has
helpers the group reads messages above 512 KiB instead of cutting them into ring slots
(``GroupContext._ring_limit``): there a 2-rank AllToAll of 64 MiB took 4.3 ms against 18.8
through the rings on one thread.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

# Copies of fewer bytes in all stay on the progressing thread, and no helper copies or reads
# less than a part: on the GPU machine's host, 2 MiB against 4 MiB took 2-rank AllToAlls of 4-8
# MiB to 0.26-0.46x Gloo's time from 0.46-0.58x and AllGathers of 2-8 MiB to 0.23-0.45x from
# 0.32-0.65x (three runs); 1 MiB was slower than either, as was a read of 8 MiB in 8 parts
# (``benchmarks/results/comm_cpu/many_core_host/copy_thresholds/``).
MIN_BYTES = 2 << 20
PART_BYTES = 2 << 20
# A collective alone in flight whose reads of its peers' pieces add up to at most this many
# bytes, and whose own pieces stay on its thread, reads them one after another in its call (the
# express path) also where the rank has reader threads (an asynchronous one: only then): on the
# 16-vCPU host handing a read of 1 MiB to a reader thread and waking for its end cost more than
# the read (a 4-rank AllToAll of 4 MiB, three 1 MiB reads: 0.61-0.67x Gloo's time read in the
# call against 0.70-0.73x on reader threads, ``benchmarks/results/comm_cpu/inline_reads/``).
INLINE_READ_BYTES = 4 << 20
# The most helpers ``auto`` gives one rank (8 reached 25–31 GB/s on the GPU machine).
AUTO_MAX_THREADS = 8

T = TypeVar("T")

_pool: ThreadPoolExecutor | None = None
_reader_pools: dict[int, ThreadPoolExecutor] = {}
_pool_lock = threading.Lock()
_busy = 0  # jobs queued or running on this process's helper and reader threads
_busy_lock = threading.Lock()


def helpers_busy() -> bool:
    """Whether a job of this process is queued or running on a helper or reader thread. A
    thread waiting for one should sleep rather than poll: a helper needs the GIL to take its
    job and to report it done, and a thread that polls with ``os.sched_yield`` takes the GIL
    back before a waking helper gets it (on the CI machine a 1 MiB read on a helper was seen
    done after a median of 480 ms while the caller polled so, 135 µs while it slept in
    ``select``: ``benchmarks/results/comm_cpu/helpers_sleep/``)."""
    return _busy > 0


def _job_ended(_: Future[Any]) -> None:
    global _busy
    with _busy_lock:
        _busy -= 1


def helper_threads(option: int, host_ranks: int, cores: int) -> int:
    """The helpers a rank copies its own pieces with (``FreescaleOptions.host_copy_threads``):
    the option where set (1: none, the progressing thread copies), else the cores this process
    may use per rank of the group on this host, at most ``AUTO_MAX_THREADS`` (1 below 2)."""
    if option > 0:
        return option
    per_rank = cores // max(1, host_ranks)
    return min(AUTO_MAX_THREADS, per_rank) if per_rank >= 2 else 1


def host_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` for host bytes, on the calling thread (one memcpy).

    Not through torch's intra-op threads: with torch's default thread count, their parallel
    copy of a large own piece plus the wait of its OpenMP workers after it took the cores the
    peers' transfers needed (AllToAll of 16 MiB on 2 ranks and 2 cores: 1.53x Gloo's time
    with torch's default threads, 0.51x with one)."""
    np.copyto(dst, src)


def host_copies(copies: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """``host_copy`` of each (dst, src) in ``copies``, in order, on the calling thread."""
    for dst, src in copies:
        host_copy(dst, src)


def parts(nbytes: int, threads: int) -> list[tuple[int, int]]:
    """[0, ``nbytes``) cut into at most ``threads`` ranges of nearly equal bytes, none of less
    than ``PART_BYTES`` unless the whole is less."""
    count = max(1, min(threads, nbytes // PART_BYTES))
    return list(itertools.pairwise(k * nbytes // count for k in range(count + 1)))


def split(
    copies: Sequence[tuple[np.ndarray, np.ndarray]], threads: int
) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """``copies`` (dst, src) cut into the jobs of ``parts`` over their bytes in order; a job is
    a list of (dst, src) ranges."""
    starts = list(itertools.accumulate((len(dst) for dst, _ in copies), initial=0))
    jobs = []
    for a, b in parts(starts[-1], threads):
        job = []
        for (dst, src), start, end in zip(copies, starts, starts[1:], strict=False):
            lo, hi = max(a, start) - start, min(b, end) - start
            if lo < hi:
                job.append((dst[lo:hi], src[lo:hi]))
        jobs.append(job)
    return [job for job in jobs if job]


class PendingCopies:
    """Local copies running on helper threads."""

    def __init__(self, futures: list[Future[None]], wake: Callable[[], None]) -> None:
        self._futures = futures
        for future in futures:
            future.add_done_callback(lambda _: wake())

    def done(self) -> bool:
        return all(future.done() for future in self._futures)

    def wait(self) -> None:
        """Blocks until every copy has ended (bounded: a memcpy), whatever its outcome."""
        for future in self._futures:
            future.exception()

    def error(self) -> str | None:
        """Why a finished copy failed, or None."""
        for future in self._futures:
            err = future.exception()
            if err is not None:
                return f"a local copy failed: {type(err).__name__}: {err}"
        return None


class LocalCopies:
    """How a group's ranks copy their own host pieces (``helper_threads`` of them).

    Args:
        threads: helpers per collective; 1 copies on the calling thread.
        wake: ends the progressing thread's sleep (``Transport.wake``) once the copies are done.
    """

    def __init__(self, threads: int, wake: Callable[[], None]) -> None:
        self.threads = threads
        self._wake = wake
        self.jobs = 0  # jobs that helpers ran (``freescale comm info``, tests)

    def on_helpers(self, copies: Sequence[tuple[np.ndarray, np.ndarray]]) -> bool:
        """Whether ``start`` gives ``copies`` to helpers (else it copies them itself)."""
        return self.threads >= 2 and sum(len(dst) for dst, _ in copies) >= MIN_BYTES

    def start(self, copies: Sequence[tuple[np.ndarray, np.ndarray]]) -> PendingCopies | None:
        """Starts ``copies`` (dst, src host bytes); None when they are done already (copied
        here: small, or no helpers)."""
        if not self.on_helpers(copies):
            host_copies(copies)
            return None
        jobs = split(copies, self.threads)
        copy_jobs = [lambda job=job: host_copies(job) for job in jobs]
        futures, refused = _submit(copy_jobs, _shared_pool())
        for job in refused:  # interpreter shutting down: copied here
            job()
        self.jobs += len(futures)
        return PendingCopies(futures, self._wake) if futures else None


def start_reads(
    reads: Sequence[tuple[Callable[[int, int], T], int, int]], wake: Callable[[], None]
) -> list[list[Future[T]]]:
    """Starts reads of other processes' memory: each ``(job, nbytes, threads)`` runs
    ``job(start, end)`` over [0, ``nbytes``) cut into at most ``threads`` parts of at least
    ``PART_BYTES``. Every part but the last runs on the process's reader threads (``threads``
    of them: the reads of several peers' messages at once, but no more of them than the rank's
    share of the cores), ``wake`` called as each ends; the last part runs here before this
    returns (a read alone then costs no hand-over to another thread and no wake-up). Returns
    each read's futures, in order; the ones run here (also those the pool refused: interpreter
    shutting down) are done on return."""
    cut = [
        [(job, a, b, threads) for a, b in parts(nbytes, threads)] for job, nbytes, threads in reads
    ]
    flat = [part for read in cut for part in read]
    futures: list[Future[T]] = []
    for job, a, b, threads in flat[:-1]:
        taken, refused = _submit([lambda job=job, a=a, b=b: job(a, b)], _reader_pool(threads))
        for future in taken:
            future.add_done_callback(lambda _: wake())
        futures += taken + [run_here(part) for part in refused]
    job, a, b, _ = flat[-1]
    futures.append(run_here(lambda: job(a, b)))
    starts = list(itertools.accumulate((len(read) for read in cut), initial=0))
    return [futures[start:end] for start, end in itertools.pairwise(starts)]


def run_here(job: Callable[[], T]) -> Future[T]:
    """``job()`` on this thread, as a done future (its exception kept, as a helper's)."""
    done: Future[T] = Future()
    try:
        done.set_result(job())
    except Exception as err:
        done.set_exception(err)
    return done


class _RunOnce:
    """A job that runs at most once, whoever calls it first: a pool that could not start a
    thread for it raises from ``submit`` with the job already queued, so a busy thread of the
    pool may still run it after the caller did (a read or copy into an output that is done)."""

    def __init__(self, job: Callable[[], T]) -> None:
        self._job = job
        self._claimed = threading.Lock()

    def __call__(self) -> Any:
        if self._claimed.acquire(blocking=False):  # never released: the one run
            return self._job()
        return None


def _submit(
    jobs: list[Callable[[], T]], pool: ThreadPoolExecutor
) -> tuple[list[Future[T]], list[Callable[[], T]]]:
    """The futures of ``jobs`` on ``pool``, in order, up to the first the pool refuses (after
    interpreter shutdown began, or when no thread can be started), and the jobs from that one
    on, which the caller runs itself (each runs once, also where the pool queued it)."""
    global _busy
    once = [_RunOnce(job) for job in jobs]
    futures: list[Future[T]] = []
    for job in once:
        with _busy_lock:
            _busy += 1
        counted = False  # whether the job's end will take it off the count
        try:
            future = pool.submit(job)
            future.add_done_callback(_job_ended)
            counted = True
        except RuntimeError:
            break
        finally:
            if not counted:  # refused, or interrupted before its callback was attached
                with _busy_lock:
                    _busy -= 1
        futures.append(future)
    return futures, once[len(futures) :]


def _shared_pool() -> ThreadPoolExecutor:
    """The process's helper threads, shared by its groups (started on first use; a thread is
    added only when no idle one can take a job)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="freescale-copy")
        return _pool


def _reader_pool(threads: int) -> ThreadPoolExecutor:
    """The process's ``threads`` reader threads (one pool per count, shared by its groups)."""
    with _pool_lock:
        pool = _reader_pools.get(threads)
        if pool is None:
            pool = _reader_pools[threads] = ThreadPoolExecutor(
                max_workers=threads, thread_name_prefix="freescale-read"
            )
        return pool
