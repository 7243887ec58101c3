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
Every rank of the host publishes its medians through the group's store and every rank applies
the same rule to the same figures (``reads_win``), so both sides of every pair on the host
choose alike. The verdict is kept per set of processes (``cached_verdict``): a later group of
the same processes on this host reuses it instead of measuring again.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from freescale_comm.errors import FreescaleError, FreescalePeerError
from freescale_comm.shm import process_alive

# A piece of a 4-rank AllToAll of 8 MiB; big enough that the copies, not the round trip, cost.
PROBE_BYTES = 2 << 20
PROBE_ROUNDS = 7  # per path, after two rounds of each that warm the slots and the buffers
_WARM_ROUNDS = 2
# The reads must take less than this share of the rings' time to be chosen: the rings keep the
# sender's pages unpinned and their slots cached, and the two measured alike within 10% on
# hosts where neither clearly won.
READS_WIN_BELOW = 0.9

# How often a wait of the probe checks that the host's other ranks still run.
_CHECK_S = 0.2

_verdicts: dict[tuple[str, ...], ProbeVerdict] = {}


@dataclass(frozen=True)
class ProbeVerdict:
    """What the ranks of one host measured, and the path chosen from it.

    Attributes:
        reads: the reads won (messages above 512 KiB are read).
        rings_s: the slowest rank's median round through the rings, in seconds.
        reads_s: the slowest rank's median round by read.
    """

    reads: bool
    rings_s: float
    reads_s: float

    def why(self) -> str:
        chosen = "the reads" if self.reads else "the rings"
        return (
            f"measured between this host's ranks at set-up ({PROBE_BYTES >> 20} MiB each: "
            f"rings {self.rings_s * 1e3:.2f} ms, reads {self.reads_s * 1e3:.2f} ms): {chosen}"
        )


def reads_win(rings_s: Sequence[float], reads_s: Sequence[float]) -> ProbeVerdict:
    """The verdict from every rank's median round per path (the slowest rank sets a
    collective's time): reads where they take less than ``READS_WIN_BELOW`` of the rings'."""
    rings, reads = max(rings_s), max(reads_s)
    return ProbeVerdict(reads < READS_WIN_BELOW * rings, rings, reads)


def cached_verdict(processes: Sequence[str]) -> ProbeVerdict | None:
    """The verdict measured earlier between exactly these processes (``liveness``'s process
    identities of the host's ranks), if any."""
    return _verdicts.get(tuple(sorted(processes)))


def measure_host(
    hub: Any,
    store: Any,
    rank: int,
    host_ranks: Sequence[int],
    processes: Sequence[str],
    links: dict[int, Any],
    tag_of: Any,
    timeout_s: float,
) -> ProbeVerdict:
    """Measures the rings against the reads with every rank of ``host_ranks`` (this one among
    them; every one calls it), and returns the verdict, the same on each of them.

    Args:
        hub: the process's ``shm.Hub``.
        store: the group's store.
        host_ranks: the group ranks on this host, sorted.
        processes: their process identities (the cache's key).
        links: this rank's ``shm.Link`` per peer of the host; the next and the previous rank
            must read each other's sends (``Channel.reads_out`` / ``reads_in``).
        tag_of: ``tag_of(src, sub)``, the tag of a probe message (``transport.make_tag``).
        timeout_s: the bound of every wait. A rank of the host whose process exits meanwhile
            fails it at once (``FreescalePeerError``).
    """
    at = host_ranks.index(rank)
    to_peer = host_ranks[(at + 1) % len(host_ranks)]
    from_peer = host_ranks[at - 1]
    deadline = time.monotonic() + timeout_s
    pids = {
        peer: links[peer].host.peer_pid
        for peer in host_ranks
        if peer != rank and links[peer] is not None and links[peer].host.peer_pid > 0
    }
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
        _finish(hub, requests, deadline, {p: pids[p] for p in (to_peer, from_peer) if p in pids})
        if k >= 2 * _WARM_ROUNDS:
            rounds[by_read].append(time.perf_counter() - started)
    for channel, sent, received, reads in counts:
        channel.sent, channel.received, channel.reads = sent, received, reads
    mine = f"{statistics.median(rounds[False])!r},{statistics.median(rounds[True])!r}"
    store.set(f"freescale/host_probe/{rank}", mine)
    keys = [f"freescale/host_probe/{r}" for r in host_ranks]
    while True:
        try:
            store.wait(keys, timedelta(seconds=_CHECK_S))
            break
        except RuntimeError:  # torch's store errors, a wait's timeout among them
            _check_alive(pids)
            if time.monotonic() > deadline:
                raise FreescaleError(
                    "the host path probe: the figures of the host's other ranks did not come "
                    "within the group timeout"
                ) from None
    figures = [tuple(map(float, bytes(v).decode().split(","))) for v in store.multi_get(keys)]
    verdict = reads_win([f[0] for f in figures], [f[1] for f in figures])
    _verdicts[tuple(sorted(processes))] = verdict
    return verdict


def _finish(hub: Any, requests: list[Any], deadline: float, pids: dict[int, int]) -> None:
    """Progresses the rings until ``requests`` complete, yielding the core between polls (the
    peers may share it); raises on an error, at ``deadline``, or once a process of ``pids``
    (group rank -> process id) has exited."""
    checked = time.monotonic()
    while not all(r.completed for r in requests):
        if not hub.progress():
            now = time.monotonic()
            if now - checked > _CHECK_S:
                checked = now
                _check_alive(pids)
            if now > deadline:
                raise FreescaleError(
                    f"the host path probe with ranks {sorted(pids)} did not finish within the "
                    "group timeout"
                )
            os.sched_yield()
    for request in requests:
        request.check_error()


def _check_alive(pids: dict[int, int]) -> None:
    """Raises ``FreescalePeerError`` if the process of a rank in ``pids`` has exited."""
    for peer, pid in sorted(pids.items()):
        if not process_alive(pid):
            raise FreescalePeerError(
                f"rank {peer}: its process on this host ({pid}) has exited during the host "
                "path probe of the group's set-up"
            )
