"""The freescale backend's control plane at 64 to 4,096 emulated ranks, against one real c10d store.

No data moves: every emulated rank is a real ``TCPStore`` client (two connections, as in the
backend: one for set-up, one of the group's own for liveness and address lookups) driving the
backend's real control-plane code — group set-up (``directory``), liveness (``liveness``), and a
collective's per-call host work (plan building, signature header, verdict) — while the store
server runs in a process of its own, whose CPU time gives the store's busy fraction (the server is
one libuv event loop: a busy fraction of 1 is all it can serve). Beside it, the same measurements
for the scheme the backend used before (every rank polls the abort key and every rank's heartbeat
four times a second; every rank reads every rank's address and host), as a faithful model kept
only here (``OldGroup``).

Per group size and scheme: set-up time and its store requests / payload bytes; over
``--measure-s`` of steady liveness traffic, store requests, key reads and payload bytes per
second and the server's busy fraction; then one emulated rank stops beating and the time every
survivor needs to learn it (and whether its error names that rank); per-call host work for N
peers. Emulated ranks share this machine's cores with each other (the real ones would not), so
the clients' own time inflates set-up and detection times here, not the store's busy fraction.

    python benchmarks/comm_scale.py --sizes 64,256,1024,4096 --out benchmarks/results/comm_scale
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from freescale_comm import algorithms, directory, liveness, validation
from freescale_comm.options import FreescaleOptions

_ADDRESS_BYTES = 230  # a UCX worker address over shared memory and TCP, as ucxx reports it
_RANKS_PER_HOST = 8


def _host(rank: int) -> str:
    """An emulated host identity as long as a real one (hostname / boot id), 8 ranks a host."""
    return f"host{rank // _RANKS_PER_HOST:05d}/00000000-0000-0000-0000-000000000000"


_OLD_HEALTH_PERIOD_S = 0.25  # the old engine's health period
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# c10d names both ends of every new connection with a reverse DNS lookup, which a resolver that
# drops some queries stalls for its 5 s timeout (here: every ~25th connection); connecting is not
# measured, but 4,096 connections should not take minutes.
_RESOLVER = {"RES_OPTIONS": "timeout:1 attempts:1"}


@dataclass(frozen=True)
class Config:
    """One run of the harness.

    Attributes:
        sizes: group sizes to emulate.
        schemes: ``new`` (the backend's code) and / or ``old`` (the model of the scheme before).
        heartbeat_s: heartbeat period (the backend's default: 1 s).
        dead_after_s: silence that makes a rank dead (default: 10 s).
        measure_s: seconds of steady liveness traffic measured per size and scheme.
        drivers: threads that tick the emulated ranks' liveness (each rank keeps its own
            connection); as many requests can be in flight at once.
        old_max_size: largest group the old scheme is run at (its set-up reads N² keys).
        addresses_max_size: largest group whose ranks all read every address (what a first
            AllToAll does: N² x 280 bytes in all).
        detect_margin_s: how long past ``dead_after_s`` survivors are waited for.
        per_call_repeats: repeats of each per-call measurement (median reported).
    """

    sizes: tuple[int, ...] = (64, 256, 1024, 4096)
    schemes: tuple[str, ...] = ("new", "old")
    heartbeat_s: float = 1.0
    dead_after_s: float = 10.0
    measure_s: float = 5.0
    drivers: int = 64
    old_max_size: int = 1024
    addresses_max_size: int = 1024
    detect_margin_s: float = 15.0
    per_call_repeats: int = 15


# ----------------------------------------------------------------------------- the store
class StoreServer:
    """A ``TCPStore`` server in a process of its own; its CPU time is the store's work."""

    def __init__(self) -> None:
        code = (
            "import sys, time, datetime, torch.distributed as d;"
            "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False,"
            " timeout=datetime.timedelta(seconds=300));"
            "print(s.port, flush=True); sys.stdin.read()"
        )
        self.process = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **_RESOLVER},
        )
        self.port = int(self.process.stdout.readline())

    def cpu_s(self) -> float:
        """CPU seconds the server process has used (user + system)."""
        with open(f"/proc/{self.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(10)


class Counted:
    """A store seen through one emulated rank: counts requests, key reads and payload bytes.

    The backend's code reaches the store only through these methods; bytes are keys and values
    both ways (the protocol's framing is not counted).
    """

    def __init__(self, store: Any, tally: Tally) -> None:
        self._store = store
        self._tally = tally

    def _count(self, keys: int, nbytes: int) -> None:
        self._tally.add(1, keys, nbytes)

    def set(self, key: str, value: Any) -> None:
        value = value.encode() if isinstance(value, str) else value
        self._store.set(key, value)
        self._count(1, len(key) + len(value))

    def get(self, key: str) -> bytes:
        value = self._store.get(key)
        self._count(1, len(key) + len(value))
        return value

    def add(self, key: str, amount: int) -> int:
        value = self._store.add(key, amount)
        self._count(1, len(key) + 8)
        return value

    def append(self, key: str, value: str) -> None:
        self._store.append(key, value)
        self._count(1, len(key) + len(value))

    def wait(self, keys: list[str], *timeout: timedelta) -> None:
        self._store.wait(keys, *timeout)
        self._count(len(keys), sum(len(k) for k in keys))

    def check(self, keys: list[str]) -> bool:
        found = self._store.check(keys)
        self._count(len(keys), sum(len(k) for k in keys))
        return found

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self._store.multi_get(keys)
        self._count(len(keys), sum(len(k) for k in keys) + sum(len(v) for v in values))
        return values

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        value = self._store.compare_set(key, expected, desired)
        self._count(1, len(key) + len(expected) + len(desired) + len(value))
        return value


@dataclass
class Tally:
    """Requests, key reads and payload bytes, summed over threads."""

    requests: int = 0
    keys: int = 0
    nbytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, requests: int, keys: int, nbytes: int) -> None:
        with self._lock:
            self.requests += requests
            self.keys += keys
            self.nbytes += nbytes

    def snapshot(self) -> tuple[int, int, int]:
        with self._lock:
            return self.requests, self.keys, self.nbytes


# ----------------------------------------------------------------------------- the schemes
class NewGroup:
    """One emulated rank of a group with the backend's code: ``directory`` set-up, then
    ``liveness.Liveness`` ticked as the engine thread ticks it."""

    def __init__(self, client: Any, tally: Tally, rank: int, size: int, config: Config) -> None:
        self.rank = rank
        root = Counted(client, tally)
        # The incarnation's exchange on the real prefix store, counted as it runs without a
        # stale request: rank 0 waits for every request, reads them, answers each and waits
        # for the confirmations; any other rank asks, waits for, reads and confirms its answer.
        if rank == 0:
            tally.add(4, 3 * (size - 1) + 1, (size - 1) * 3 * 48)
        else:
            tally.add(4, 4, 4 * 48)
        group_store = dist.PrefixStore(f"bench/new/{size}", client)
        group_keys = directory.incarnation_keys(group_store, rank, size, timedelta(seconds=600))
        keys = Counted(group_keys, tally)
        directory.start(keys, root, rank, FreescaleOptions().shared())
        # As the backend: liveness and the address lookups on a connection of the group's own.
        own = Counted(liveness.own_connection(group_keys), tally)
        self.liveness = liveness.Liveness(own, rank, size, config.heartbeat_s, config.dead_after_s)
        self.directory = directory.Directory(
            keys,
            rank,
            size,
            _host(rank),
            os.urandom(_ADDRESS_BYTES),
            timedelta(seconds=600),
            lookups=own,
        )
        if len(self.directory.same_host) != min(_RANKS_PER_HOST, size - rank // 8 * 8):
            raise AssertionError(f"rank {rank} found {self.directory.same_host} on its host")

    def read_all_addresses(self) -> None:
        """What a first AllToAll makes this rank read: every peer's address."""
        for peer in range(self.directory.size):
            self.directory.address(peer)

    @property
    def next_due(self) -> float:
        return self.liveness.next_due

    def tick(self, now: float) -> None:
        self.liveness.tick(now)

    def error(self) -> str | None:
        return self.liveness.error()


class OldGroup:
    """One emulated rank of a group as the backend made it before: a model of that code.

    Set-up: rank 0 writes the group id; every rank writes its process id and address, reads all
    of them (one ``multi_get`` of N keys), writes its host identity and reads all of those. Then
    a per-process heartbeat counter bumped every ``heartbeat_s``, and while a collective is in
    flight (always, here) every 0.25 s a ``check`` of the abort key and a ``multi_get`` of every
    rank's counter; a rank whose counter stood still for ``dead_after_s`` is dead; the first
    rank that fails writes the abort key (``check`` then ``set``), which the others ``check``.
    """

    def __init__(self, client: Any, tally: Tally, rank: int, size: int, config: Config) -> None:
        self.rank, self.size, self.config = rank, size, config
        prefix = f"old/{size}"
        self.store = store = Counted(dist.PrefixStore(prefix, client), tally)
        self.root = root = Counted(client, tally)
        process_id = f"{size:04d}{rank:012d}"
        self.key = f"freescale/hb/{process_id}"
        root.add(self.key, 1)
        if rank == 0:
            store.set("freescale/group_id", str(root.add("freescale/next_group_id", 1)))
        int(store.get("freescale/group_id"))
        store.set(f"freescale/peer/{rank}", process_id.encode() + os.urandom(_ADDRESS_BYTES))
        entries = store.multi_get([f"freescale/peer/{p}" for p in range(size)])
        self.beat_keys = [f"freescale/hb/{bytes(e[:16]).decode()}" for e in entries]
        store.set(f"freescale/host/{rank}", _host(rank))
        store.multi_get([f"freescale/host/{p}" for p in range(size)])
        now = time.monotonic()
        self.beats = [(b"", now)] * size
        self.next_beat = now + config.heartbeat_s
        self.next_health = now
        self.failed: str | None = None

    @property
    def next_due(self) -> float:
        return min(self.next_beat, self.next_health)

    def tick(self, now: float) -> None:
        if now >= self.next_beat:
            self.root.add(self.key, 1)
            self.next_beat = now + self.config.heartbeat_s
        if now >= self.next_health and self.failed is None:
            self.next_health = now + _OLD_HEALTH_PERIOD_S
            self.failed = self._health(time.monotonic())
            if self.failed is not None and not self.store.check(["freescale/abort"]):
                self.store.set("freescale/abort", f"rank {self.rank}: {self.failed}")

    def _health(self, now: float) -> str | None:
        if self.store.check(["freescale/abort"]):
            reason = self.store.get("freescale/abort").decode()
            return f"the group was aborted by {reason}"
        values = self.root.multi_get(self.beat_keys)
        dead = []
        for peer, raw in enumerate(values):
            seen, since = self.beats[peer]
            if raw != seen:
                self.beats[peer] = (bytes(raw), now)
            elif peer != self.rank and now - since > self.config.dead_after_s:
                dead.append(peer)
        return f"rank {dead[0]}: its process died or is stopped" if dead else None

    def error(self) -> str | None:
        return self.failed


_SCHEMES: dict[str, Callable[..., Any]] = {"new": NewGroup, "old": OldGroup}


# ----------------------------------------------------------------------------- phases
def connect(port: int, count: int) -> list[Any]:
    """``count`` store clients, one connection each (what ``count`` ranks would hold)."""

    def client(_: int) -> Any:
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))

    with ThreadPoolExecutor(32) as pool:
        return list(pool.map(client, range(count)))


def on_every_rank(groups: list[Any], work: Callable[[Any], None]) -> float:
    """Runs ``work(group)`` for every emulated rank at once (one thread each); returns the time
    from the start to the last rank done."""
    errors: list[BaseException] = []
    go = threading.Event()

    def rank_main(group: Any) -> None:
        go.wait()
        try:
            work(group)
        except BaseException as err:  # reported after the join
            errors.append(err)

    threading.stack_size(256 << 10)
    threads = [threading.Thread(target=rank_main, args=(g,), daemon=True) for g in groups]
    for thread in threads:
        thread.start()
    start = time.monotonic()
    go.set()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.monotonic() - start


def set_up(scheme: str, clients: list[Any], tally: Tally, config: Config) -> tuple[list, float]:
    """Every emulated rank creates its group at once; returns the ranks and the time from the
    start to the last rank done."""
    size = len(clients)
    groups: list[Any] = [None] * size

    def create(rank: int) -> None:
        groups[rank] = _SCHEMES[scheme](clients[rank], tally, rank, size, config)

    elapsed = on_every_rank(list(range(size)), create)
    return groups, elapsed


def store_capacity(server: StoreServer, seconds: float, threads: int = 16) -> dict[str, float]:
    """Requests a second the store serves per second of its own CPU, for the liveness request
    (a ``multi_get`` of 4 small keys) from ``threads`` connections as fast as they can."""
    clients = connect(server.port, threads)
    keys = ["cap/abort", "cap/left_count", "cap/hb/1", "cap/hb/2"]
    clients[0].set(keys[0], b"")
    clients[0].set(keys[1], b"")
    clients[0].add(keys[2], 1)
    clients[0].add(keys[3], 1)
    counts = [0] * threads
    halt = threading.Event()

    def hammer(index: int) -> None:
        client = clients[index]
        while not halt.is_set():
            client.multi_get(keys)
            counts[index] += 1

    workers = [threading.Thread(target=hammer, args=(i,), daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    time.sleep(0.5)
    served0, cpu0, wall0 = sum(counts), server.cpu_s(), time.monotonic()
    time.sleep(seconds)
    served1, cpu1, wall1 = sum(counts), server.cpu_s(), time.monotonic()
    halt.set()
    for worker in workers:
        worker.join()
    busy = (cpu1 - cpu0) / (wall1 - wall0)
    rate = (served1 - served0) / (wall1 - wall0)
    return {
        "served_per_s": rate,
        "store_busy_fraction": busy,
        "requests_per_store_cpu_s": rate / busy if busy > 0 else float("nan"),
    }


class Drivers:
    """Threads that tick every live emulated rank when it is due, as each rank's engine would,
    and record when each rank first reports an error."""

    def __init__(self, groups: list[Any], threads: int) -> None:
        self.groups = groups
        self.stopped: set[int] = set()
        self.first_error: dict[int, tuple[float, str]] = {}
        self.lag: list[float] = []  # how late ticks ran (the clients' own saturation)
        self._halt = threading.Event()
        self._lock = threading.Lock()
        shares = [list(range(i, len(groups), threads)) for i in range(threads)]
        self._threads = [
            threading.Thread(target=self._drive, args=(share,), daemon=True) for share in shares
        ]
        for thread in self._threads:
            thread.start()

    def _drive(self, ranks: list[int]) -> None:
        while not self._halt.is_set():
            now = time.monotonic()
            soonest = now + 0.05
            for rank in ranks:
                if rank in self.stopped:
                    continue
                group = self.groups[rank]
                due = group.next_due
                if now >= due:
                    with self._lock:
                        self.lag.append(now - due)
                    group.tick(now)
                    if rank not in self.first_error:
                        error = group.error()
                        if error is not None:
                            with self._lock:
                                self.first_error[rank] = (time.monotonic(), error)
                    due = group.next_due
                    now = time.monotonic()
                soonest = min(soonest, due)
            delay = soonest - time.monotonic()
            if delay > 0:
                self._halt.wait(delay)

    def close(self) -> None:
        self._halt.set()
        for thread in self._threads:
            thread.join()


def steady_load(
    drivers: Drivers, tally: Tally, server: StoreServer, seconds: float
) -> dict[str, float]:
    """Store traffic and the server's busy fraction over ``seconds`` of liveness."""
    time.sleep(min(2.0, seconds / 2))  # past set-up's last requests and the first ticks
    with drivers._lock:
        drivers.lag.clear()
    requests0, keys0, bytes0 = tally.snapshot()
    cpu0, wall0 = server.cpu_s(), time.monotonic()
    client0 = time.process_time()
    time.sleep(seconds)
    requests1, keys1, bytes1 = tally.snapshot()
    cpu1, wall1 = server.cpu_s(), time.monotonic()
    client1 = time.process_time()
    wall = wall1 - wall0
    with drivers._lock:
        lag = sorted(drivers.lag)
    return {
        "requests_per_s": (requests1 - requests0) / wall,
        "key_reads_per_s": (keys1 - keys0) / wall,
        "bytes_per_s": (bytes1 - bytes0) / wall,
        "store_busy_fraction": (cpu1 - cpu0) / wall,
        "clients_cpu_fraction": (client1 - client0) / wall,
        "tick_lag_p50_s": lag[len(lag) // 2] if lag else 0.0,
        "tick_lag_p99_s": lag[int(len(lag) * 0.99)] if lag else 0.0,
    }


def detect_death(drivers: Drivers, victim: int, config: Config) -> dict[str, Any]:
    """Stops the victim's beats and polls; times how long every survivor takes to learn it."""
    size = len(drivers.groups)
    killed = time.monotonic()
    drivers.stopped.add(victim)
    deadline = killed + config.dead_after_s + config.detect_margin_s
    survivors = [r for r in range(size) if r != victim]
    while time.monotonic() < deadline:
        if all(r in drivers.first_error for r in survivors):
            break
        time.sleep(0.05)
    delays = [drivers.first_error[r][0] - killed for r in survivors if r in drivers.first_error]
    named = [
        f"rank {victim}" in drivers.first_error[r][1] for r in survivors if r in drivers.first_error
    ]
    return {
        "victim": victim,
        "survivors": len(survivors),
        "survivors_told": len(delays),
        "all_named_victim": bool(named) and all(named),
        "max_s": max(delays) if delays else None,
        "median_s": statistics.median(delays) if delays else None,
        "bound_s": config.dead_after_s + 2.0,
        "sample_error": drivers.first_error[survivors[0]][1]
        if survivors[0] in drivers.first_error
        else None,
    }


# ----------------------------------------------------------------------------- per call
def _median_us(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def per_call_work(size: int, repeats: int) -> dict[str, float]:
    """Host work of one small AllToAll / AllGather on one rank of ``size``: plan building (new
    shape, and a shape the plan cache knows), and the signature header: encoding it, the bytes
    this rank sends per call (one header to each peer), and judging the table of every peer's
    header (first time, and as the cached-shape path does: the table's bytes looked up)."""
    rank = size // 2
    options = FreescaleOptions()
    inp, out = torch.arange(size, dtype=torch.int64), torch.empty(size, dtype=torch.int64)
    cache = algorithms.PlanCache()
    algorithms.all_to_all_single("a2a", rank, size, out, inp, [], [], cache)
    gathered = torch.empty(size, dtype=torch.int64)
    piece = torch.ones(1, dtype=torch.int64)
    plan = algorithms.all_to_all_single("a2a", rank, size, out, inp, [], [])
    signature = plan.signature
    result = {
        "plan_a2a_new_shape_us": _median_us(
            lambda: algorithms.all_to_all_single("a2a", rank, size, out, inp, [], []), repeats
        ),
        "plan_a2a_cached_us": _median_us(
            lambda: algorithms.all_to_all_single("a2a", rank, size, out, inp, [], [], cache),
            repeats,
        ),
        "plan_allgather_new_shape_us": _median_us(
            lambda: algorithms.all_gather_into_tensor(
                "ag", rank, size, [gathered], [piece], options
            ),
            repeats,
        ),
    }
    # Every rank of an even AllToAll encodes the same fields but for its own position.
    headers = []
    for r in range(size):
        sig = algorithms.all_to_all_single("a2a", r, size, out, inp, [], []).signature
        headers.append(sig.encode(size))
    result["header_encode_us"] = _median_us(lambda: signature.encode(size), repeats)
    result["header_bytes"] = float(validation.Signature.size(size))
    result["header_bytes_sent_per_call"] = float(validation.Signature.size(size) * (size - 1))
    result["judge_first_us"] = _median_us(
        lambda: validation.judge(headers, size), max(3, repeats // 3)
    )
    good = {b"".join(h.tobytes() for h in headers)}
    result["judge_cached_us"] = _median_us(
        lambda: b"".join(h.tobytes() for h in headers) in good, repeats
    )
    return result


def old_per_call_work(size: int, repeats: int) -> dict[str, float]:
    """The header work of the full signature table (every rank's sizes to and from every peer
    in each header), as every collective did before: the backend keeps that encoding for the
    diagnosis round after a bad digest (``validation.Signature.encode_table``)."""
    out = torch.empty(size, dtype=torch.int64)
    inp = torch.arange(size, dtype=torch.int64)
    headers = [
        algorithms.all_to_all_single("a2a", r, size, out, inp, [], []).signature.encode_table(size)
        for r in range(size)
    ]
    signature = algorithms.all_to_all_single("a2a", size // 2, size, out, inp, [], []).signature
    table_size = validation.Signature.table_size(size)
    good = {b"".join(h.tobytes() for h in headers)}
    return {
        "header_encode_us": _median_us(lambda: signature.encode_table(size), repeats),
        "header_bytes": float(table_size),
        "header_bytes_sent_per_call": float(table_size * (size - 1)),
        "judge_first_us": _median_us(
            lambda: validation.judge_table(headers, size), max(3, repeats // 3)
        ),
        "judge_cached_us": _median_us(
            lambda: b"".join(h.tobytes() for h in headers) in good, repeats
        ),
    }


# ----------------------------------------------------------------------------- run
def offered_load(scheme: str, size: int, config: Config) -> dict[str, float]:
    """The liveness traffic a scheme asks of the store, from its periods (requests and key
    reads a second): what real ranks would send, whether or not the store keeps up."""
    beats = size / config.heartbeat_s
    if scheme == "new":
        polls = size / liveness.poll_period(config.dead_after_s)
        keys_per_poll = 1 + min(liveness.WATCHED, size - 1)
        return {"requests_per_s": beats + polls, "key_reads_per_s": beats + polls * keys_per_poll}
    polls = size / _OLD_HEALTH_PERIOD_S  # a check and a multi_get of every counter, each
    return {"requests_per_s": beats + 2 * polls, "key_reads_per_s": beats + polls * (1 + size)}


def run_one(server: StoreServer, scheme: str, size: int, config: Config) -> dict[str, Any]:
    """Set-up, steady load and death detection of one group of ``size`` emulated ranks."""
    tally = Tally()
    start = time.monotonic()
    clients = connect(server.port, size)
    connect_s = time.monotonic() - start
    cpu0 = server.cpu_s()
    groups, setup_s = set_up(scheme, clients, tally, config)
    setup_cpu = server.cpu_s() - cpu0
    requests, keys, nbytes = tally.snapshot()
    record: dict[str, Any] = {
        "scheme": scheme,
        "size": size,
        "connect_s": connect_s,
        "setup": {
            "seconds": setup_s,
            "store_cpu_s": setup_cpu,
            "requests": requests,
            "requests_per_rank": requests / size,
            "key_reads": keys,
            "bytes": nbytes,
        },
    }
    if scheme == "new" and size <= config.addresses_max_size:
        requests0, keys0, bytes0 = tally.snapshot()
        cpu0 = server.cpu_s()
        seconds = on_every_rank(groups, NewGroup.read_all_addresses)
        requests1, keys1, bytes1 = tally.snapshot()
        record["all_addresses"] = {
            "seconds": seconds,
            "store_cpu_s": server.cpu_s() - cpu0,
            "requests": requests1 - requests0,
            "key_reads": keys1 - keys0,
            "bytes": bytes1 - bytes0,
        }
    drivers = Drivers(groups, config.drivers)
    try:
        live = record["liveness"] = steady_load(drivers, tally, server, config.measure_s)
        offered = live["offered"] = offered_load(scheme, size, config)
        # The store's work scales with the key reads it serves (measured here): at the offered
        # rate it would be this busy (above 1: it cannot keep up, requests queue, beats are late).
        if live["key_reads_per_s"] > 0:
            live["projected_busy_fraction"] = (
                live["store_busy_fraction"] * offered["key_reads_per_s"] / live["key_reads_per_s"]
            )
        record["death"] = detect_death(drivers, size // 2, config)
    finally:
        drivers.close()
    for client in clients:
        del client
    return record


def run(config: Config, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    server = StoreServer()
    results: dict[str, Any] = {
        "config": asdict(config),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "commit": _commit(),
        "load_average_start": os.getloadavg(),
        "runs": [],
        "per_call": [],
    }
    try:
        results["store_capacity"] = store_capacity(server, min(3.0, config.measure_s))
        print(f"store capacity: {results['store_capacity']}", flush=True)
        for size in config.sizes:
            for scheme in config.schemes:
                if scheme == "old" and size > config.old_max_size:
                    continue
                record = run_one(server, scheme, size, config)
                results["runs"].append(record)
                _print_run(record)
            results["per_call"].append(
                {
                    "size": size,
                    "new": per_call_work(size, config.per_call_repeats),
                    "old": old_per_call_work(size, config.per_call_repeats),
                }
            )
            _print_per_call(results["per_call"][-1])
    finally:
        server.close()
    results["load_average_end"] = os.getloadavg()
    (out / "comm_scale.json").write_text(json.dumps(results, indent=1))
    _plot(results, out / "comm_scale.png")
    return results


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _print_run(r: dict[str, Any]) -> None:
    live, death, setup = r["liveness"], r["death"], r["setup"]
    print(
        f"{r['scheme']:>3} N={r['size']:5d}: set-up {setup['seconds']:6.2f} s "
        f"({setup['requests_per_rank']:.1f} req/rank, {setup['bytes'] / 1e6:.1f} MB) | liveness "
        f"{live['requests_per_s']:8.0f} req/s {live['key_reads_per_s']:9.0f} keys/s "
        f"{live['bytes_per_s'] / 1e6:6.2f} MB/s busy {live['store_busy_fraction']:.2f} "
        f"(offered {live['offered']['key_reads_per_s']:.0f} keys/s: "
        f"{live.get('projected_busy_fraction', float('nan')):.2f}) | "
        f"death: {death['survivors_told']}/{death['survivors']} told, max "
        f"{death['max_s'] if death['max_s'] is None else round(death['max_s'], 2)} s, "
        f"named {death['all_named_victim']}",
        flush=True,
    )


def _print_per_call(p: dict[str, Any]) -> None:
    new, old = p["new"], p["old"]
    print(
        f"    N={p['size']:5d} per call: plan a2a {new['plan_a2a_new_shape_us']:.0f} µs new shape, "
        f"{new['plan_a2a_cached_us']:.0f} µs cached | header {new['header_bytes']:.0f} B "
        f"(old {old['header_bytes']:.0f} B), sent {new['header_bytes_sent_per_call'] / 1e3:.0f} kB "
        f"(old {old['header_bytes_sent_per_call'] / 1e3:.0f} kB), judge "
        f"{new['judge_first_us']:.0f}/{new['judge_cached_us']:.0f} µs "
        f"(old {old['judge_first_us']:.0f}/{old['judge_cached_us']:.0f} µs)",
        flush=True,
    )


def _plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels: Sequence[tuple[str, Callable[[dict[str, Any]], float | None]]] = (
        (
            "store busy fraction from liveness, at the offered rate",
            lambda r: r["liveness"].get("projected_busy_fraction"),
        ),
        (
            "store key reads / s offered (liveness)",
            lambda r: r["liveness"]["offered"]["key_reads_per_s"],
        ),
        ("group set-up (s)", lambda r: r["setup"]["seconds"]),
        ("set-up store bytes", lambda r: r["setup"]["bytes"]),
        ("last survivor told of a death (s)", lambda r: r["death"]["max_s"]),
    )
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, value) in zip(axes.flat, panels, strict=False):
        plotted: list[float] = []
        for scheme, style in (("new", "o-"), ("old", "s--")):
            runs = [r for r in results["runs"] if r["scheme"] == scheme]
            points = [(r["size"], value(r)) for r in runs if value(r) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), style, label=scheme)
                plotted += [y for _, y in points]
        ax.set_xscale("log", base=2)
        # A dry run's tiny sizes can measure 0, which a log axis cannot show.
        if "told" not in title and plotted and min(plotted) > 0:
            ax.set_yscale("log")
        if "fraction" in title:
            ax.axhline(0.2, color="grey", lw=0.8, ls=":")
            ax.axhline(1.0, color="red", lw=0.8, ls=":")
        if "told" in title:
            ax.axhline(results["config"]["dead_after_s"] + 2, color="grey", lw=0.8, ls=":")
        ax.set_title(title)
        ax.set_xlabel("emulated ranks")
        ax.legend()
    ax = axes.flat[-1]
    for scheme, key, style in (
        ("new", "header_bytes_sent_per_call", "o-"),
        ("old", "header_bytes_sent_per_call", "s--"),
    ):
        points = [(p["size"], p[scheme][key]) for p in results["per_call"]]
        ax.plot(*zip(*points, strict=True), style, label=f"{scheme}: header bytes sent / call")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title("per call, one rank")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    os.environ.update(_RESOLVER)  # read by the resolver at its first lookup
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64,256,1024,4096")
    parser.add_argument("--schemes", default="new,old")
    parser.add_argument("--heartbeat-s", type=float, default=1.0)
    parser.add_argument("--dead-after-s", type=float, default=10.0)
    parser.add_argument("--measure-s", type=float, default=5.0)
    parser.add_argument("--drivers", type=int, default=64)
    parser.add_argument("--old-max-size", type=int, default=1024)
    parser.add_argument("--addresses-max-size", type=int, default=1024)
    parser.add_argument("--detect-margin-s", type=float, default=15.0)
    parser.add_argument("--per-call-repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("out/comm_scale"))
    args = parser.parse_args(argv)
    config = Config(
        sizes=tuple(int(s) for s in args.sizes.split(",")),
        schemes=tuple(args.schemes.split(",")),
        heartbeat_s=args.heartbeat_s,
        dead_after_s=args.dead_after_s,
        measure_s=args.measure_s,
        drivers=args.drivers,
        old_max_size=args.old_max_size,
        addresses_max_size=args.addresses_max_size,
        detect_margin_s=args.detect_margin_s,
        per_call_repeats=args.per_call_repeats,
    )
    run(config, args.out)


if __name__ == "__main__":
    main()
