"""Rings or reads for large host messages, measured between the ranks of one host at set-up.

A host message above the rings' limit is read by its receiver from the sender's memory (one
copy, but the kernel pins each page it reads); below it, it goes through the rings' slots (two
copies, through slots that stay in the cache). Where torch's tensors get huge pages, or every
rank has helper threads to split its reads over, the reads win from a few MiB on every host
measured (``GroupContext._ring_limit``). With 4 KiB pages and no helpers, no rule does: on a 2-core
AMD EPYC machine the rings took 0.85–0.97x the reads' time on 4 ranks, on a 2-core Intel Xeon
machine the reads took 0.72–0.85x the rings' (``benchmarks/results/comm_cpu/host_paths/``), and
a probe inside one process picked the wrong one there. So the ranks of the host measure both,
all at once as a collective would: each sends ``PROBE_BYTES`` to the next rank of the host and
receives as much from the previous one, through the rings and by read, in alternating rounds.
Every rank of the host publishes its rounds' times through the group's store and every rank
applies the same rule to the same figures (``reads_win``), so both sides of every pair on the
host choose alike. The verdict is kept per set of processes and ring geometry
(``verdict_key``): a later group of the same processes reuses it instead of measuring again,
where every rank of the group has it (the group agrees on that first).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from freescale_comm.errors import FreescaleError, FreescalePeerError

# A piece of a 4-rank AllToAll of 8 MiB; big enough that the copies, not the round trip, cost.
PROBE_BYTES = 2 << 20
# Per path, after two rounds of each that warm the slots and the buffers. With 4 ranks on 2
# cores a round's time varies by up to 2x (a rank descheduled mid-round); over 11 rounds the
# verdict held in 30 groups of 30 where the copies favoured one path by 20-30%.
PROBE_ROUNDS = 11
_WARM_ROUNDS = 2
# The reads are chosen where they take less than this share of the rings' time: the faster
# path, the rings on a tie.
READS_WIN_BELOW = 1.0

# How often a wait of the probe asks whether to stop (a rank of the host gone, or given up).
_CHECK_S = 0.2

_verdicts: dict[tuple[str, ...], ProbeVerdict] = {}


@dataclasses.dataclass(frozen=True)
class ProbeVerdict:
    """What the ranks of one host measured, and the path chosen from it.

    Attributes:
        reads: the reads won (messages above 512 KiB are read).
        rings_s: the median over the rounds through the rings of the slowest rank's time in
            the round, in seconds.
        reads_s: the same by read.
        measured_s: how long this rank took to measure, wait for its peers' figures included
            (0 where nobody measured).
    """

    reads: bool
    rings_s: float
    reads_s: float
    measured_s: float = 0.0

    def why(self) -> str:
        chosen = "the reads" if self.reads else "the rings"
        return (
            f"measured between this host's ranks at set-up ({PROBE_BYTES >> 20} MiB each: "
            f"rings {self.rings_s * 1e3:.2f} ms, reads {self.reads_s * 1e3:.2f} ms): {chosen}"
        )


def reads_win(
    rings_rounds: Sequence[Sequence[float]], reads_rounds: Sequence[Sequence[float]]
) -> ProbeVerdict:
    """The verdict from every rank's times per round (``rings_rounds[r][k]``: rank ``r``'s
    ``k``-th round through the rings): a round takes its slowest rank's time, as a collective
    does, and each path its median round; the reads where theirs is under ``READS_WIN_BELOW``
    of the rings'. The slowest rank of each round rather than each rank's median: which rank
    a descheduling slows differs from round to round, and a collective waits for it."""
    rings, reads = (
        statistics.median(map(max, zip(*by_rank, strict=True)))
        for by_rank in (rings_rounds, reads_rounds)
    )
    return ProbeVerdict(reads < READS_WIN_BELOW * rings, rings, reads)


def verdict_key(processes: Sequence[str], slots: int, slot_bytes: int) -> tuple[str, ...] | None:
    """What a verdict is kept under: the process identities of the host's ranks (``liveness``'s
    ``process_identity``) and the rings' geometry; None where an identity is unknown (empty),
    which could name another process: then nothing is kept."""
    if not all(processes):
        return None
    return (*sorted(processes), f"{slots}x{slot_bytes}")


def cached_verdict(key: tuple[str, ...] | None) -> ProbeVerdict | None:
    """The verdict kept under ``key``, if any."""
    return None if key is None else _verdicts.get(key)


def keep_verdict(key: tuple[str, ...] | None, verdict: ProbeVerdict) -> None:
    if key is not None:
        _verdicts[key] = verdict


def measure_host(
    hub: Any,
    store: Any,
    rank: int,
    host_ranks: Sequence[int],
    links: dict[int, Any] | Sequence[Any],
    tag_of: Callable[[int, int], int],
    timeout_s: float,
    stop: Callable[[], str | None],
) -> ProbeVerdict:
    """Measures the rings against the reads with every rank of ``host_ranks`` (this one among
    them; every one calls it), and returns the verdict, the same on each of them.

    Args:
        hub: the process's ``shm.Hub``.
        store: the group's store.
        host_ranks: the group ranks on this host, sorted.
        links: this rank's ``shm.Link`` per peer; the next and the previous rank of the host
            must read each other's sends (``Channel.reads_out`` / ``reads_in``).
        tag_of: ``tag_of(src, sub)``, the tag of a probe message (``transport.make_tag``).
        timeout_s: the bound of every wait.
        stop: asked every ``_CHECK_S`` while waiting: why to give up (a rank of the host whose
            process exited, or that gave up the set-up), raised as ``FreescalePeerError``.
    """
    at = host_ranks.index(rank)
    to_peer = host_ranks[(at + 1) % len(host_ranks)]
    from_peer = host_ranks[at - 1]
    began = time.monotonic()
    deadline = began + timeout_s
    send = np.ones(PROBE_BYTES, dtype=np.uint8)  # touched: no page faults in the rounds
    recv = np.zeros(PROBE_BYTES, dtype=np.uint8)
    rounds: dict[bool, list[float]] = {False: [], True: []}
    # The counts of messages that ``paths`` reports are the group's traffic, not the probe's.
    channels = {id(links[p].host): links[p].host for p in (to_peer, from_peer)}.values()
    counts = [(c, c.sent, c.received, c.reads) for c in channels]
    for k in range(2 * (PROBE_ROUNDS + _WARM_ROUNDS)):
        by_read = bool(k % 2)
        started = time.perf_counter()
        requests = [
            hub.post(links[from_peer], recv, tag_of(from_peer, k + 1), send=False),
            hub.post(links[to_peer], send, tag_of(rank, k + 1), send=True, by_read=by_read),
        ]
        _finish(hub, requests, deadline, stop)
        if k >= 2 * _WARM_ROUNDS:
            rounds[by_read].append(time.perf_counter() - started)
    for channel, sent, received, reads in counts:
        channel.sent, channel.received, channel.reads = sent, received, reads
    store.set(f"freescale/host_probe/{rank}", json.dumps([rounds[False], rounds[True]]))
    keys = [f"freescale/host_probe/{r}" for r in host_ranks]
    _wait_for_keys(store, keys, deadline, stop)
    figures = [json.loads(bytes(v)) for v in store.multi_get(keys)]
    verdict = reads_win([f[0] for f in figures], [f[1] for f in figures])
    return dataclasses.replace(verdict, measured_s=time.monotonic() - began)


def _finish(hub: Any, requests: list[Any], deadline: float, stop: Callable[[], str | None]) -> None:
    """Progresses the rings until ``requests`` complete, yielding the core between polls (the
    peers may share it); raises on an error, once ``stop`` gives a reason, or at
    ``deadline``."""
    checked = time.monotonic()
    while not all(r.completed for r in requests):
        moved = hub.progress()
        now = time.monotonic()
        if now - checked > _CHECK_S:  # also while other groups' traffic keeps the hub moving
            checked = now
            _raise_if_stopped(stop)
            if now > deadline:
                raise FreescaleError(
                    "the host path probe of the group's set-up did not finish within the "
                    "group timeout"
                )
        if not moved:
            os.sched_yield()
    for request in requests:
        request.check_error()


def _wait_for_keys(
    store: Any, keys: list[str], deadline: float, stop: Callable[[], str | None]
) -> None:
    """Waits for ``keys`` in ``store`` in steps of ``_CHECK_S``, asking ``stop`` between them;
    a store that fails sooner than a step raises at once."""
    while True:
        asked = time.monotonic()
        try:
            store.wait(keys, timedelta(seconds=_CHECK_S))
            return
        except RuntimeError:  # torch's store errors: a wait's timeout, or the store gone
            if time.monotonic() - asked < _CHECK_S / 2:
                raise
        _raise_if_stopped(stop)
        if time.monotonic() > deadline:
            raise FreescaleError(
                "the host path probe: the figures of the host's other ranks did not come "
                "within the group timeout"
            )


def _raise_if_stopped(stop: Callable[[], str | None]) -> None:
    reason = stop()
    if reason is not None:
        raise FreescalePeerError(f"the host path probe of the group's set-up stopped: {reason}")
