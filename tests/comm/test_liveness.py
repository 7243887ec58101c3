"""The control plane: ring liveness, set-up directory, and their behaviour in real groups.

Liveness and set-up run here against a real c10d ``TCPStore`` (in this process), several ranks'
worth of them on threads; the multi-process tests use real ranks over UCX. The scale harness
(``benchmarks/comm_scale.py``) runs once at a small size.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from freescale_comm import directory, liveness
from freescale_comm.liveness import Departure
from tests.comm import liveness_ranks
from tests.comm.conftest import FAST_FAILURE_ENV, SETUP
from tests.harness import GroupSpec, LocalGroup, RankFailure, free_port, run_ranks, run_sessions

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def store():
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    yield server


def _client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))


@pytest.mark.parametrize("size", [2, 3, 5, 64])
def test_every_dead_set_is_watched_by_a_live_rank(size):
    rng = random.Random(size)
    for _ in range(200):
        dead = set(rng.sample(range(size), rng.randint(1, size - 1)))
        watching = [
            p for r in range(size) if r not in dead for p in liveness.watched_ranks(r, size)
        ]
        assert dead & set(watching), (size, dead)
    assert liveness.watched_ranks(0, 1) == [] and liveness.watched_ranks(1, 2) == [0]


def _group(server, size, prefix, heartbeat_s=0.05, dead_after_s=0.4, on_failure=None):
    keys = dist.PrefixStore(prefix, _client(server))
    liveness.create_keys(keys)
    return [
        liveness.Liveness(
            dist.PrefixStore(prefix, _client(server)),
            r,
            size,
            heartbeat_s,
            dead_after_s,
            (lambda error, r=r: on_failure(r, error)) if on_failure else None,
        )
        for r in range(size)
    ]


def _tick_for(ranks, seconds, skip=()):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for rank, live in enumerate(ranks):
            if rank not in skip:
                live.tick(time.monotonic())
        time.sleep(0.005)


def test_a_silent_rank_is_reported_by_every_rank_naming_it(store):
    ranks = _group(store, 6, "g1")
    _tick_for(ranks, 0.6)
    assert all(live.error() is None for live in ranks)
    silent_since = time.monotonic()
    told: dict[int, float] = {}
    while len(told) < 5 and time.monotonic() < silent_since + 5:
        _tick_for(ranks, 0.02, skip={3})
        for rank, live in enumerate(ranks):
            if rank != 3 and rank not in told and live.error() is not None:
                told[rank] = time.monotonic() - silent_since
    assert sorted(told) == [0, 1, 2, 4, 5]
    # Within dead_after_s + 2 s (a stall of this loop longer than a few polls restarts the
    # watchers' clocks: a loaded machine may take most of the 2 s).
    assert max(told.values()) < 0.4 + 2, told
    # A watcher of rank 3 (1 or 2) named it first; the others learned it from the abort key.
    direct = [r for r in (1, 2) if ranks[r].error().startswith("rank 3 (rank 3 sent no heart")]
    assert direct, [ranks[r].error() for r in (1, 2)]
    for rank in {0, 1, 2, 4, 5} - set(direct):
        assert ranks[rank].error().startswith("the group was aborted by rank "), rank
        assert "rank 3 (rank 3 sent no heartbeat" in ranks[rank].error()


def test_watchers_dying_with_their_rank_still_leave_it_reported(store):
    # Ranks 3, 4 and 5 die together (a host): rank 3's watchers are 1 and 2, alive; 5's watchers
    # 3 and 4 die with it. The live rank before the run (2) watches 3 and 4.
    ranks = _group(store, 8, "g2")
    _tick_for(ranks, 0.3)
    _tick_for(ranks, 1.2, skip={3, 4, 5})
    for rank in (0, 1, 2, 6, 7):
        error = ranks[rank].error()
        assert error is not None and ("rank 3" in error or "rank 4" in error), (rank, error)


def test_a_watcher_stopped_itself_does_not_blame_its_neighbours(store):
    ranks = _group(store, 3, "g3")
    _tick_for(ranks, 0.3)
    # Rank 0 is stopped (not ticked) for longer than dead_after_s while 1 and 2 keep beating
    # but nobody polls (else rank 2, watching 0, would rightly report it).
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        ranks[1].beat()
        ranks[2].beat()
        time.sleep(0.05)
    _tick_for(ranks, 0.1)
    assert ranks[0].error() is None
    # Really silent neighbours while rank 0 polls throughout: reported.
    _tick_for(ranks, 0.8, skip={1, 2})
    assert ranks[0].error() is not None and "rank 1" in ranks[0].error()


def test_abort_first_reason_wins_and_stops_the_polls(store):
    ranks = _group(store, 4, "g4")
    assert ranks[2].abort("rank 2: first") == "rank 2: first"
    assert ranks[1].abort("rank 1: second") == "rank 2: first"
    _tick_for(ranks, 0.2)
    assert all(live.error() == "the group was aborted by rank 2: first" for live in ranks)


class _CountedStore:
    """A store whose requests are counted (the liveness's own store behind it)."""

    def __init__(self, store):
        self._store, self.requests = store, 0

    def __getattr__(self, name):
        self.requests += 1
        return getattr(self._store, name)


def _sleeping_child() -> tuple[subprocess.Popen, str, int]:
    """A process that sleeps a minute, its PID namespace and start time (once /proc has it)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    deadline = time.monotonic() + 10
    while liveness.process_start_time(child.pid) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    namespace = liveness.process_identity().split("/")[1]
    return child, namespace, liveness.process_start_time(child.pid)


def test_only_processes_that_are_the_ones_published_are_watched(store):
    # A peer process is watched only if it is in this PID namespace and its start time, read
    # here, is the one it published (else, as in containers that share a host's /dev/shm but
    # not its PIDs, the pid would name another process); its exit is then found by a check.
    child, namespace, started = _sleeping_child()
    try:
        keys = _client(store)
        liveness.create_keys(keys)
        for peer in (1, 2):  # the ranks rank 0 watches by heartbeat: alive
            keys.add(liveness.beat_key(peer), 1)
        live = liveness.Liveness(keys, 0, 5, 0.1, 10.0)
        live.watch_processes(
            {
                1: f"{child.pid}/{namespace}/{started}",
                2: f"{child.pid}/0:0/{started}",  # another PID namespace
                3: f"{child.pid}/{namespace}/{started + 1}",  # another process, same pid
                4: "",  # /proc could not tell
            }
        )
        assert list(live._processes) == [1]
        live.poll(time.monotonic())
        assert live.error() is None
        child.kill()
        child.wait()
        live.check_processes()
        assert live.error() == f"rank 1: its process on this host (pid {child.pid}) has exited"
    finally:
        child.kill()
        child.wait()


def test_a_set_up_whose_store_fails_first_raises_the_stores_error():
    # Its shutdown read the group's abort reason from a liveness not made yet: AttributeError.
    from freescale_comm.group import GroupContext
    from freescale_comm.options import FreescaleOptions

    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
    # A client's connection attempts last its timeout (the liveness's own connection is one).
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=3))
    keys = dist.PrefixStore("early", client)
    del server
    with pytest.raises(RuntimeError) as raised:
        GroupContext(keys, keys, 0, 2, timedelta(seconds=5), FreescaleOptions())
    assert not isinstance(raised.value, AttributeError), raised.value


def test_a_store_whose_host_is_gone_is_retried_ever_less_often():
    # Each failed request makes torch log a warning with a stack trace; a rank idling after the
    # store's host exited logged two a second for as long as it lived, then one per retry.
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
    ranks = _group(server, 2, "gone", heartbeat_s=0.05, dead_after_s=0.5)
    for live in ranks:
        live.store = _CountedStore(live.store)
    _tick_for(ranks, 0.3)
    assert all(live.error() is None for live in ranks)
    del server  # its host leaves: every later request fails
    before = [live.store.requests for live in ranks]
    _tick_for(ranks, 3.0)
    for live, start in zip(ranks, before, strict=True):
        # Not a failure by itself (its host may have finished its part of the job): one for
        # collectives that wait longer than dead_after_s (GroupContext.health_error).
        assert live.error() is None and "the c10d store is unreachable" in live.store_error
        assert re.search(r"unreachable for \d+ s", live.store_silence())
        # Retries 0.1, 0.2, 0.4, 0.8 and 1.6 s apart, not 60 beats and 60 polls; each asks
        # the server's port first, which refuses: a request (and torch's stack trace) only
        # for the first failure (two where one was on its way as the server left).
        assert live.store.requests - start <= 2, live.store.requests - start
        assert "Connection refused" in live.store_error, live.store_error


def test_a_rank_that_read_the_abort_key_stops_polling(store):
    # It polled at once on every engine tick, forever: a core spent by an idle process.
    ranks = _group(store, 3, "done", heartbeat_s=0.2, dead_after_s=2.0)
    ranks[1].abort("rank 1: gone")
    _tick_for(ranks[:1], 0.3)
    assert ranks[0].aborted == "rank 1: gone"
    time.sleep(0.5)  # past the poll that would have been next
    ranks[0].tick(time.monotonic())
    assert ranks[0].next_due > time.monotonic()  # its next beat, not a poll already due


class _FailingStore:
    """Answers until ``up`` is cleared, then fails every request (a stand-in for the backoff's
    arithmetic only)."""

    up = True

    def add(self, key, value):
        if not self.up:
            raise RuntimeError("store gone")
        return 1

    def multi_get(self, keys):
        if not self.up:
            raise RuntimeError("store gone")
        return [b"", b"0"] + [b"1"] * (len(keys) - 2)

    def get(self, key):
        if not self.up:
            raise RuntimeError("store gone")
        return b""

    def compare_set(self, key, expected, desired):
        if not self.up:
            raise RuntimeError("store gone")
        self.written = desired
        return desired


def test_the_store_retry_period_stays_bounded_however_long_the_store_is_gone():
    # The period doubled without bound: after 1,024 failures (8.5 h) it overflowed and the
    # exception ended the engine thread of every group.
    store = _FailingStore()
    live = liveness.Liveness(store, 0, 3, 1.0, 10.0)
    store.up = False
    for _ in range(2000):
        now = live.next_due
        live.tick(now)
        assert 0 < live.next_due - now <= 30.0 + 1e-6
    assert live.error() is None
    assert "the c10d store has been unreachable for" in live.store_silence()


def test_a_store_back_between_two_retries_fails_no_collective():
    # The outage counted up to now: a store down for 8 s (retries 1, 2, 4 s apart, then 8) was
    # back at 8 s, but from 10 s until the retry at 15 s every collective that had waited over
    # dead_after_s (10 s) failed for it.
    store = _FailingStore()
    live = liveness.Liveness(store, 0, 3, 1.0, 10.0)
    start = live.next_due
    store.up = False
    now = start
    while now < start + 8:
        live.tick(now)
        now = live.next_due
    store.up = True
    assert now > start + 10  # the next retry comes after dead_after_s
    assert live.store_silence() is None
    live.tick(now)
    assert live.store_silence() is None and live.store_error is None
    # Down for good: the outage shows once a failed retry comes after dead_after_s, which one
    # is made just then (the doubling alone put it at 15 s).
    store.up = False
    down = ticked = now
    while live.store_silence() is None:
        ticked = now
        live.tick(now)
        now = live.next_due
    assert ticked - down <= 10 + 1.0, ticked - down
    assert "the c10d store has been unreachable for" in live.store_silence()


def test_ranks_that_left_are_not_watched_and_the_next_live_rank_is(store):
    # Ranks 1 and 2 destroy the group and fall silent; then rank 3, which only they watched,
    # dies: the ranks before them (0 and 4) must watch past them.
    ranks = _group(store, 5, "left1")
    _tick_for(ranks, 0.3)
    for rank, gloo_calls in ((1, 2), (2, 3)):
        ranks[rank].start()
        ranks[rank].stop(Departure(finished=7, gloo_calls=gloo_calls))
    _tick_for(ranks, 1.0, skip={1, 2})  # longer than dead_after_s (0.4 s)
    for rank in (0, 3, 4):
        assert ranks[rank].error() is None, (rank, ranks[rank].error())
        assert ranks[rank].departed == {1: (7, 2), 2: (7, 3)}
    assert ranks[0].watched == [3, 4] and ranks[4].watched == [0, 3]
    _tick_for(ranks, 1.2, skip={1, 2, 3})
    for rank in (0, 4):
        error = ranks[rank].error()
        assert error is not None and "rank 3" in error and "rank 1" not in error, (rank, error)


class _FlakyStore:
    """A real store whose named methods fail the next ``failures`` calls."""

    def __init__(self, store, **failures):
        self._store, self.failures = store, failures

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def call(*args):
            if self.failures.get(name, 0) > 0:
                self.failures[name] -= 1
                raise RuntimeError(f"{name} failed")
            return method(*args)

        return call


def test_a_departure_is_recorded_after_store_failures(store):
    # A store that failed the last poll (store_error still set) got no record, and an add
    # that failed after the append left the count unchanged: the peers never read it.
    ranks = _group(store, 3, "left3")
    flaky = ranks[1].store = _FlakyStore(ranks[1].store, add=1)
    ranks[1].tick(ranks[1].next_due + 1.0)
    assert ranks[1].store_error is not None
    flaky.failures["add"] = 1  # the tick's beat took the first
    ranks[1].start()
    ranks[1].stop(Departure(finished=5, gloo_calls=0))
    _tick_for([ranks[0]], 0.3)
    assert ranks[0].departed == {1: (5, 0)}


def test_an_abort_told_by_an_outbox_reaches_the_ranks_of_other_hosts(store):
    # Ranks 0-2 share a host, 3-4 do not. Rank 2 aborted (its outbox says why) and exited
    # without the abort key in the store: ranks 0 and 1 name its reason, and must write the
    # key, since only they watch its process.
    child, namespace, started = _sleeping_child()
    reason = "rank 2: collective #5 did not finish within 3 s"
    try:
        ranks = _group(store, 5, "told")
        for rank in (0, 1):
            ranks[rank].watch_processes({2: f"{child.pid}/{namespace}/{started}"})
            ranks[rank].local_aborts = lambda: {2: reason}
        _tick_for(ranks, 0.3)
        child.kill()
        child.wait()
        _tick_for(ranks, 1.0, skip={2})
        for rank in (0, 1, 3, 4):
            assert ranks[rank].error() == f"the group was aborted by {reason}", rank
    finally:
        child.kill()
        child.wait()


def test_the_exit_of_a_peer_that_left_is_no_failure(store):
    # It wrote its record and exited before this rank's next poll read it.
    child, namespace, started = _sleeping_child()
    try:
        told: list[str] = []
        live = _group(store, 3, "left2", dead_after_s=10.0, on_failure=lambda r, e: told.append(e))
        live[0].watch_processes({1: f"{child.pid}/{namespace}/{started}"})
        live[0].tick(time.monotonic())
        live[1].start()
        live[1].stop(Departure(finished=3, gloo_calls=1))
        child.kill()
        child.wait()
        live[0].check_processes()
        assert live[0].error() is None and told == [] and live[0].departed == {1: (3, 1)}
    finally:
        child.kill()
        child.wait()


def test_every_rank_is_told_once_of_a_silent_rank_and_of_an_abort(store):
    # What no collective polls (a sealed IPC collective waits on the GPU) learns of it here.
    told: list[tuple[int, str]] = []
    ranks = _group(store, 4, "g5", on_failure=lambda rank, error: told.append((rank, error)))
    _tick_for(ranks, 0.3)
    assert told == []
    end = time.monotonic() + 5
    while len({r for r, _ in told}) < 3 and time.monotonic() < end:
        _tick_for(ranks, 0.02, skip={2})
    _tick_for(ranks, 0.3, skip={2})  # more polls tell nobody twice
    assert sorted(r for r, _ in told) == [0, 1, 3], told
    assert all("rank 2" in error for _, error in told), told
    # A group aborted on purpose: every rank is told, the aborting one included.
    told.clear()
    ranks = _group(store, 3, "g6", on_failure=lambda rank, error: told.append((rank, error)))
    ranks[1].abort("rank 1: abort() was called")
    _tick_for(ranks, 0.3)
    assert sorted(r for r, _ in told) == [0, 1, 2], told
    # The reason as written (the group says "aborted by" once, in front of it).
    assert {e for _, e in told} == {"rank 1: abort() was called"}


def _join(clients, size, prefix, hosts):
    """Ranks 0..size-1 set up a directory at once, rank r through ``clients[r]`` (its store
    connection, also its root store, as ``root_store`` finds it under a group's prefix)."""
    found: list[directory.Directory | None] = [None] * size
    errors = []

    def rank_main(rank):
        try:
            keys = directory.incarnation_keys(
                dist.PrefixStore(prefix, clients[rank]), rank, size, timedelta(seconds=60)
            )
            directory.start(keys, clients[rank], rank, "")
            found[rank] = directory.Directory(
                keys, rank, size, hosts[rank], f"address of {rank}".encode(), timedelta(seconds=60)
            )
        except Exception as err:
            errors.append(err)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    return found


def test_directory_reads_addresses_only_on_use_and_incarnations_stay_apart(store):
    size = 10  # blocks of 4: 0-3, 4-7, 8-9
    hosts = [f"host{r % 3}" for r in range(size)]
    # One connection per rank process, kept over its incarnations (each new connection costs
    # reverse name lookups, which a rate-limited resolver answers after seconds).
    clients = [_client(store) for _ in range(size)]
    first = _join(clients, size, "d", hosts)
    assert len({d.group_id for d in first}) == 1
    for rank, d in enumerate(first):
        assert d.same_host == [p for p in range(size) if hosts[p] == hosts[rank]]
        assert d.blocks_read == 0
    assert first[0].address(1) == b"address of 1" and first[0].blocks_read == 1
    assert first[0].address(3) == b"address of 3" and first[0].blocks_read == 1
    assert first[0].host_of(9) == "host0" and first[0].blocks_read == 1  # same host: known
    assert first[0].host_of(8) == "host2" and first[0].blocks_read == 2
    # The same prefix again (init_process_group after destroy): new keys, not the old ones.
    second = _join(clients, size, "d", [f"other{r}" for r in range(size)])
    assert second[0].group_id != first[0].group_id
    assert second[5].address(2) == b"address of 2" and second[5].host_of(2) == "other2"
    assert all(d.same_host == [r] for r, d in enumerate(second))
    # A group of another size under the same prefix (a smaller world after a failure).
    third = _join(clients, 3, "d", ["h"] * 3)
    assert third[2].same_host == [0, 1, 2] and third[2].address(0) == b"address of 0"


def test_scale_harness_dry_run(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import comm_scale
    finally:
        sys.path.pop(0)
    comm_scale.main(
        [
            "--sizes=16",
            "--measure-s=0.5",
            "--heartbeat-s=0.2",
            "--dead-after-s=1",
            "--detect-margin-s=4",
            "--drivers=4",
            "--per-call-repeats=3",
            f"--out={tmp_path}",
        ]
    )
    result = json.loads((tmp_path / "comm_scale.json").read_text())
    runs = {r["scheme"]: r for r in result["runs"]}
    assert set(runs) == {"new", "old"}
    new, old = runs["new"], runs["old"]
    assert new["setup"]["requests_per_rank"] <= 11
    assert new["all_addresses"]["requests"] == 16 * 4  # every block, by every rank
    assert new["death"]["survivors_told"] == 15 and new["death"]["all_named_victim"]
    assert new["death"]["max_s"] < new["death"]["bound_s"]
    assert old["death"]["survivors_told"] == 15
    offered_new = new["liveness"]["offered"]["key_reads_per_s"]
    assert offered_new < old["liveness"]["offered"]["key_reads_per_s"]
    per_call = result["per_call"][0]
    assert per_call["new"]["header_bytes"] == 280 < per_call["old"]["header_bytes"]
    assert result["store_capacity"]["requests_per_store_cpu_s"] > 0


# ----------------------------------------------------------------------------- real ranks
def _raised_after(detail: str) -> float:
    """The seconds a rank's "... raised after X s: ..." message reports (its traceback holds the
    message's source line too)."""
    return float(re.findall(r"raised after (\d+\.\d) s", detail)[-1])


def _fast_group(world_size: int, env: dict[str, str] | None = None) -> LocalGroup:
    group = LocalGroup(
        world_size,
        backend="freescale",
        setup=SETUP,
        init_timeout_s=30,
        env={**FAST_FAILURE_ENV, **(env or {})},
    )
    group.start()
    return group


@pytest.mark.parametrize(
    ("world_size", "op"),
    [
        (2, "all_to_all"),
        (4, "all_to_all"),
        (3, "all_reduce"),
        (3, "barrier"),
        (3, "ddp"),
        (3, "all_reduce_polled"),
        (3, "send_recv"),
        (3, "recv_any"),
        (3, "send_recv:two_gloo_devices"),
    ],
)
def test_stopped_peer_makes_every_survivor_raise(world_size, op):
    # all_reduce, barrier, DDP's allreduce, send and recv run on the group's Gloo backend,
    # whose wait for a stopped peer lasts until the group timeout (60 s here): the liveness
    # thread's abort ends it too, DDP's wait on the future in its backward included, and a
    # caller's loop of is_completed on an AllReduce (Gloo's own handle is never completed
    # then); also where Gloo has a context per network device (a send or recv takes one by its
    # tag).
    op, _, devices = op.partition(":")
    group = _fast_group(world_size, {"GLOO_SOCKET_IFNAME": "lo,lo"} if devices else None)
    victim = world_size - 1
    try:
        # The victim answers once every survivor raised (survivor 0 resumes it), so a passing
        # run ends then; the bound only ends a run where some survivor hangs.
        with pytest.raises(RankFailure) as failure:
            group.run(liveness_ranks.stop_during_collective, victim, 0.5, op, timeout_s=15)
    finally:
        group.close()
    assert failure.value.results == {victim: 0.0}, failure.value
    for survivor in range(victim):
        kind, detail = failure.value.failures[survivor]
        assert kind == "error" and f"survivor {survivor} raised after" in detail, detail
        assert f"rank {victim}" in detail.split(f"survivor {survivor} raised after")[1]
        if op in ("send_recv", "recv_any"):
            assert "[all_reduce: FreescalePeerError]" in detail, detail
        seconds = _raised_after(detail)
        # dead_after_s = 3 after the stop (0.5 s in), plus the 2 s the bound allows.
        assert seconds < 0.5 + 3 + 2, detail


@pytest.mark.parametrize(
    "op", ["all_to_all", "all_reduce", "all_reduce_polled", "send_recv", "recv_any", "isend"]
)
def test_abort_makes_every_other_rank_raise_at_once(fs_group4, op):
    # isend: sends posted back to back, never waited for; the aborting rank's connections close
    # before the others read the abort key, and a post must still raise the abort's error.
    # all_reduce_polled: a polled AllReduce that Gloo failed first (the closed connections)
    # names the abort, as a wait does, not Gloo's error.
    # On a subgroup of the shared world: the others' errors come back as results, and the world
    # outlives the aborted group.
    results = fs_group4.run(liveness_ranks.abort_during_collective, 1, 0.5, op, timeout_s=30)
    assert results[1]["error"] is None  # the aborting rank returned
    for rank in (0, 2, 3):
        detail = results[rank]["error"]
        assert "aborted by rank 1: abort() was called" in detail, detail
        seconds = _raised_after(detail)
        assert seconds < 0.5 + 2, detail  # the abort key, not dead_after_s
        # A collective on Gloo called after the abort is refused at once, naming it.
        later = results[rank]["later"]
        assert f"rank {rank}: allreduce on Gloo: the group was aborted earlier by rank 1: " in later
    assert all(r["world"] == [0.0, 1.0, 2.0, 3.0] for r in results), results


def test_a_polled_collective_on_gloo_is_forgotten_once_done(local_groups):
    # Counted as waiting on Gloo while rank 0 polls it (rank 1 comes late), not after: a work
    # kept past its end would hold its tensors, and count as a wait when the store later stops.
    group = local_groups.get(2, backend="freescale", setup=SETUP, init_timeout_s=60)
    results = group.run(liveness_ranks.polled_collective_is_forgotten_once_done, timeout_s=60)
    assert results[0]["counted"] == 1, results
    for result in results:
        assert result["left"] == 0 and result["error"] is None, results
        assert result["sum"] == [3.0] * 4, results


def test_a_dead_peer_breaks_only_the_groups_it_is_in():
    group = _fast_group(4)
    try:
        with pytest.raises(RankFailure) as failure:
            group.run(liveness_ranks.dead_peer_in_one_of_two_groups, 3, 600, timeout_s=60)
    finally:
        group.close()
    assert failure.value.failures[3][0] == "died"
    results = failure.value.results
    assert set(results) == {0, 1, 2}, failure.value
    for rank in (0, 1):
        assert results[rank]["rounds"] == 600 and results[rank]["seconds"] >= 6.0
    error = results[2]["error"]
    # Group rank 1 of the second group is global rank 3, on this host: its exit is seen, and
    # the error says which world ranks the group's are.
    assert "rank 1: its process on this host" in error and "has exited" in error, error
    assert "rank 0 of 2, world ranks 2-3)" in error, error
    on_gloo = results[2]["on_gloo"]
    assert on_gloo.startswith("rank 0 of group ") and " (world ranks 2-3): " in on_gloo, on_gloo


def test_an_incarnation_is_agreed_after_attempts_whose_ranks_did_not_all_join(store):
    # A counter of joins gave the ranks of every later attempt different incarnations once one
    # attempt's rank 1 never joined (torchrun restarts its workers on the same store).
    size, prefix = 3, "attempts"
    clients = [_client(store) for _ in range(size)]

    def incarnation(rank, timeout_s=30.0):
        keys = directory.incarnation_keys(
            dist.PrefixStore(prefix, clients[rank]), rank, size, timedelta(seconds=timeout_s)
        )
        keys.set(f"seen/{rank}", "1")
        return keys

    def attempt(ranks, delays, timeout_s=30.0):
        found, errors = {}, {}

        def rank_main(rank):
            time.sleep(delays.get(rank, 0.0))
            try:
                found[rank] = incarnation(rank, timeout_s)
            except Exception as err:
                errors[rank] = err

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in ranks]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        return found, errors

    # Attempt 0: rank 1 never joins; rank 0 and rank 2 give up, naming who is missing.
    _, errors = attempt([0, 2], {}, timeout_s=1.0)
    assert "rank(s) [1] did not join" in str(errors[0]), errors
    assert "no answer from rank 0 within 1 s" in str(errors[2]), errors
    # Attempt 1: rank 0 never joins; the others' requests stay behind.
    _, errors = attempt([1, 2], {}, timeout_s=1.0)
    assert sorted(errors) == [1, 2], errors
    assert all("no answer from rank 0" in str(e) for e in errors.values()), errors
    # Attempt 2: rank 0 reads the stale requests first and answers them; ranks 1 and 2 ask
    # again later, and all three agree.
    found, errors = attempt([0, 1, 2], {1: 0.3, 2: 0.5})
    assert not errors, errors
    for rank in range(size):
        assert all(found[rank].check([f"seen/{r}"]) for r in range(size)), rank


_RESTARTED_WORKER = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import freescale_comm  # noqa: F401
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 0 and rank == int(sys.argv[1]):
    time.sleep(1.0)  # its peers are in their set-up by then
    raise SystemExit("dies before init_process_group")
dist.init_process_group("freescale", timeout=timedelta(seconds=30))
x = torch.ones(2)
dist.all_reduce(x)
y = torch.empty(2)
dist.all_to_all_single(y, torch.full((2,), float(rank)))
print(f"attempt {attempt} rank {rank}: {x.tolist()} {y.tolist()}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("dies", [0, 1])
def test_torchrun_restarts_workers_after_one_died_before_joining(tmp_path, dies):
    # Every restart failed (a counter of joins put the ranks in different incarnations once
    # one rank of an attempt never joined), where plain Gloo's restart worked.
    script = tmp_path / "worker.py"
    script.write_text(_RESTARTED_WORKER)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--max-restarts", "1", "--master-addr", "127.0.0.1", f"--master-port={free_port()}",
        str(script), str(dies),
    ]  # fmt: skip
    ((status, output),) = run_sessions([(command, None)], timeout_s=120)
    assert status == 0, output[-4000:]
    for rank in (0, 1):
        assert f"attempt 1 rank {rank}: [2.0, 2.0] [0.0, 1.0]" in output, output[-4000:]


def test_reinitialisation_from_the_same_store():
    group = _fast_group(2)
    try:
        assert group.run(liveness_ranks.reinit_twice, 3, timeout_s=60) == [[5.0, 5.0]] * 2
    finally:
        group.close()


@pytest.mark.parametrize(("hosts", "in_flight"), [(1, True), (1, False), (2, True), (2, False)])
def test_a_collective_a_peer_left_before_raises_instead_of_waiting_for_the_timeout(
    local_groups, hosts, in_flight
):
    # Before, the departed peer's silence was taken for a death (one host: ignored, since its
    # process runs) and a collective it never started waited for the group timeout (60 s).
    group = local_groups.get(3, setup=SETUP, init_timeout_s=60)
    results = group.run(liveness_ranks.leave_a_group_and_live_on, 1, hosts, in_flight, timeout_s=40)
    assert results[1] == {"error": None}
    for rank in (0, 2):
        error, seconds = results[rank]["error"], results[rank]["seconds"]
        assert "a peer destroyed the process group (rank 1 after collective #3)" in error, error
        assert "collective #4 cannot complete" in error and "died" not in error, error
        assert "aborted" not in error, error  # every rank learns of it: no abort needed
        # Within a poll (0.1 s) and a health check; at once for a call made after it (the
        # bound leaves room for a loaded machine: without the departure record it is 60 s).
        assert seconds < (1.5 if in_flight else 1.0), (rank, seconds, error)


@pytest.mark.parametrize(
    ("hosts", "in_flight", "via_future"),
    [(1, True, False), (1, False, False), (2, True, False), (1, True, True)],
)
def test_a_collective_on_gloo_a_peer_left_before_raises_instead_of_waiting_for_the_timeout(
    local_groups, hosts, in_flight, via_future
):
    # Before, such an AllReduce waited for the group timeout (60 s), or for the leaver's exit
    # where Gloo then raised "Connection closed by peer"; the one the leaver ran completes.
    group = local_groups.get(3, setup=SETUP, init_timeout_s=60)
    results = group.run(
        liveness_ranks.leave_a_group_with_gloo_calls_pending,
        1,
        hosts,
        in_flight,
        via_future,
        timeout_s=40,
    )
    assert results[1] == {"sum": [6.0] * 4}
    for rank in (0, 2):
        error, seconds = results[rank]["error"], results[rank]["seconds"]
        assert results[rank]["sum"] == [6.0] * 4, results[rank]
        assert "allreduce on Gloo: a peer destroyed the process group" in error, error
        assert "(rank 1 after 1 on Gloo), so its collective #2 on Gloo" in error, error
        assert "aborted" not in error, error
        # Within a step of the wait (0.1 s); at once for a call made after it.
        assert seconds < (0.5 if in_flight else 0.1), (rank, seconds, error)


@pytest.mark.parametrize(
    ("pause", "hosts"),
    [
        # Before: its peer's watcher declared rank 0 dead after 1 s; the group was aborted.
        ("late_new_group", 2),  # heartbeats alone judge a peer on another host
        ("gil", 1),  # a peer on this host whose process runs is not dead
    ],
)
def test_a_rank_busy_longer_than_dead_after_s_is_not_declared_dead(local_groups, pause, hosts):
    group = local_groups.get(2, setup=SETUP, init_timeout_s=60)
    results = group.run(liveness_ranks.busy_but_alive, pause, 3.0, hosts, timeout_s=60)
    assert results == [[1.0, 2.0]] * 2, results


def test_a_group_outlives_the_store_until_a_collective_waits_past_dead_after_s():
    # Before: the first collective after the store's host left failed ("the group was aborted
    # earlier: the c10d store is unreachable"), although no peer had died.
    group = LocalGroup(3, backend=None, setup=SETUP, init_timeout_s=30)
    try:
        group.start()
        results = group.run(liveness_ranks.outlive_the_store, 3.0, timeout_s=60)
    finally:
        group.close()
    assert results[0] == {"calls": 0, "error": None}
    for rank in (1, 2):
        assert results[rank]["calls"] == 300, results
    # Rank 1 waited for the stalled rank 2 without a store to tell it whether rank 2 lives.
    error = results[1]["error"]
    assert "the c10d store has been unreachable for" in error and "has waited" in error, error


def test_a_peer_process_gone_is_reported_while_the_store_is_down():
    # The process check ran inside the store's poll: with the store down it never ran, and a
    # same-host peer's exit went unreported (its collectives waited for the group timeout).
    child, namespace, started = _sleeping_child()
    try:
        store = _FailingStore()
        told: list[str] = []
        live = liveness.Liveness(store, 0, 3, 0.1, 1.0, on_failure=told.append)
        live.watch_processes({1: f"{child.pid}/{namespace}/{started}"})
        store.up = False
        child.kill()
        child.wait()
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            live.tick(time.monotonic())
            time.sleep(0.02)
        # Named as the abort key will: who found what, not "aborted by" the dead rank.
        assert told == [f"rank 0: rank 1: its process on this host (pid {child.pid}) has exited"]
        # The abort key could not be written; it is, once the store answers again.
        assert not hasattr(store, "written")
        store.up = True
        live.tick(live.next_due)
        assert store.written == told[0].encode()
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(
    "op",
    [
        "all_to_all",
        "all_reduce",
        "all_reduce_sliced",
        "all_reduce_polled",
        "send_recv",
        "ddp",
    ],
)
def test_a_stopped_store_host_is_reported_within_dead_after_s(op):
    # Before: rank 1's liveness poll and its abort waited for the stopped store's answer (up
    # to the store's timeout), on the engine thread and in the caller: rank 1 raised only once
    # the store's host was resumed, and other groups' collectives stalled with it. A wait on
    # the group's Gloo backend (all_reduce, send / recv) lasted until Gloo's timeout (60 s),
    # and a caller that polls an AllReduce's handle instead of waiting never counted as
    # waiting.
    group = LocalGroup(2, backend=None, setup=SETUP, init_timeout_s=30)
    try:
        group.start()
        results = group.run(liveness_ranks.store_host_stopped, 1.0, 12.0, op, timeout_s=90)
    finally:
        group.close()
    survivor = results[1]
    # dead_after_s = 2 s after the first unanswered request (each 0.5 s), checked each 0.05 s.
    assert survivor["raised_after_s"] < 5.0, results
    assert "the c10d store has not answered a request for" in survivor["error"], results
    assert results[0]["error"] is not None, results  # resumed into an aborted group


def test_the_store_host_leaving_first_fails_no_collective_it_finished():
    # Its process's exit was found before its departure could be read from the store, which
    # left with it: the others' last AllToAll failed ("its process on this host has exited").
    spec = GroupSpec(3, None, setup=SETUP, init_timeout_s=30)
    with pytest.raises(RankFailure) as failure:
        run_ranks(spec, liveness_ranks.store_host_leaves_first, timeout_s=60, stop_on_error=False)
    results = failure.value.results
    assert set(results) == {1, 2}, failure.value
    for rank in (1, 2):
        assert results[rank]["right"], results
        error = results[rank]["error"]
        assert "a peer destroyed the process group (rank 0 after collective #2)" in error, error


def _run_where_a_rank_exits(world_size: int, backend: str, function) -> dict:
    """Runs ``function`` on fresh ranks of a world group on ``backend``, one of which exits
    (``os._exit``); returns the others' results."""
    group = LocalGroup(world_size, backend=backend, setup=SETUP, init_timeout_s=30)
    try:
        group.start()
        with pytest.raises(RankFailure) as failure:
            group.run(function, timeout_s=60)
    finally:
        group.close()
    return failure.value.results


def test_a_destroy_lets_an_unwaited_collective_on_gloo_finish():
    # Before, the leaver's destroy returned at once and its exit dropped the AllReduce: the
    # others raised Gloo's "Connection closed by peer", counted as run by its departure.
    results = _run_where_a_rank_exits(
        3, "gloo", liveness_ranks.leave_with_a_gloo_call_unwaited_and_exit
    )
    assert results[0] == results[2] == {"sum": [6.0] * 4}, results


def test_a_collective_timing_out_on_gloo_fails_the_group_with_its_reason(local_groups):
    # Before, the rank raised Gloo's own RuntimeError and its peers named its exit (one
    # host) or Gloo's "Connection closed by peer" (two hosts), or nothing until their own
    # Gloo timeout.
    group = local_groups.get(3, setup=SETUP, init_timeout_s=60)
    results = group.run(liveness_ranks.time_out_on_gloo, timeout_s=40)
    assert results[1].startswith("FreescaleTimeoutError: rank 1: allreduce on Gloo failed:")
    for rank in (0, 2):
        assert "the group was aborted" in results[rank], results[rank]
        assert "rank 1: allreduce on Gloo failed" in results[rank], results[rank]


def test_an_abort_is_named_where_the_store_left_with_the_rank_that_wrote_it():
    # Rank 0 hosts the store and exits right after its collective timed out: rank 1 found its
    # process gone before its poll read the abort key, and named the exit ("rank 0: its
    # process on this host has exited"). Rank 0's outbox now says why it aborted.
    spec = GroupSpec(2, None, setup=SETUP, init_timeout_s=30)
    with pytest.raises(RankFailure) as failure:
        run_ranks(
            spec,
            liveness_ranks.exit_right_after_a_timeout_taking_the_store,
            timeout_s=60,
            stop_on_error=False,
        )
    error = failure.value.results[1]
    assert "the group was aborted" in error and "did not finish within 3 s" in error, error
    assert "has exited" not in error, error


def test_an_abort_reaches_the_store_before_its_raise_returns():
    # The abort key is written by the liveness thread: a rank that exited right after its
    # collective raised left the key unwritten, and its peer's later call paired with the
    # dead rank's data still in the ring and returned no error.
    error = _run_where_a_rank_exits(2, "freescale", liveness_ranks.exit_right_after_a_timeout)[1]
    assert "the group was aborted" in error and "did not finish within 3 s" in error, error
