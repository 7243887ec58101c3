"""Pieces that need no group: options, tags, signatures, registration, the CLI's info."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from importlib.metadata import entry_points
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

from freescale_comm import FreescaleOptions
from freescale_comm.algorithms import _may_overlap
from freescale_comm.cpu import cgroup_cpu_quota, usable_cores
from freescale_comm.engine import (
    ALONE_YIELDS,
    POLL_S,
    YIELD_S,
    Engine,
    alone_yields,
    idle_poll_s,
)
from freescale_comm.errors import FreescaleError
from freescale_comm.local_copies import LocalCopies, helper_threads, split, start_reads
from freescale_comm.transport import MAX_SUB, make_tag
from freescale_comm.validation import (
    NEEDS_TABLE,
    Signature,
    judge,
    judge_table,
    layout,
    names_ipc,
    verdict,
    with_own_error,
)


@pytest.mark.parametrize(
    ("ranks", "spans"),
    [
        ([2, 3], "2-3"),
        ([5], "5"),
        ([0, 2, 4], "0, 2, 4"),
        ([3, 4, 5, 9, 1, 2], "3-5, 9, 1-2"),
        (list(range(0, 40, 2)), "0, 2, 4, 6, 8, 10, 12, 14, ..."),
    ],
)
def test_world_ranks_are_named_by_runs(ranks, spans):
    from freescale_comm.group import rank_spans

    assert rank_spans(ranks) == spans


def test_overlap_of_inputs_and_outputs_matches_every_pair():
    storage = torch.zeros(64)
    rng = np.random.default_rng(0)
    for _ in range(300):

        def views(count: int) -> list[torch.Tensor]:
            starts = rng.integers(0, 60, count)
            return [storage[s : s + int(rng.integers(0, 64 - s))] for s in starts]

        inputs, outputs = views(int(rng.integers(0, 6))), views(int(rng.integers(0, 6)))
        pairwise = any(
            a.nbytes
            and b.nbytes
            and a.data_ptr() < b.data_ptr() + b.nbytes
            and b.data_ptr() < a.data_ptr() + a.nbytes
            for a in inputs
            for b in outputs
        )
        assert _may_overlap(inputs, outputs) == pairwise, (inputs, outputs)
    # A strided tensor is sent from (or received into) a copy: it overlaps nothing here.
    assert not _may_overlap([storage[::2]], [storage[:8]])


def test_options_from_env_and_explicit_values(monkeypatch):
    monkeypatch.setenv("FREESCALE_VALIDATE", "0")
    monkeypatch.setenv("FREESCALE_CHUNK_BYTES", "0x1000")
    monkeypatch.setenv("FREESCALE_ALLGATHER", "ring")
    options = FreescaleOptions.from_env(FreescaleOptions(allgather="direct"))
    assert options.validate is False
    assert options.chunk_bytes == 4096
    assert options.allgather == "direct"  # set explicitly in pg_options: wins over the env
    monkeypatch.setenv("FREESCALE_HEARTBEAT_S", "often")
    with pytest.raises(ValueError, match="FREESCALE_HEARTBEAT_S"):
        FreescaleOptions.from_env()
    with pytest.raises(ValueError, match="allgather"):
        FreescaleOptions(allgather="tree")
    with pytest.raises(ValueError, match="idle_wait"):
        FreescaleOptions(idle_wait="spin")
    # Values that compare as if valid, or not at all: NaN would turn off peer-death detection.
    monkeypatch.setenv("FREESCALE_HEARTBEAT_S", "1")
    monkeypatch.setenv("FREESCALE_DEAD_AFTER_S", "nan")
    with pytest.raises(ValueError, match="dead_after_s must be a finite number"):
        FreescaleOptions.from_env()
    for field, value, says in [
        ("validate", "no", "a bool"),
        ("chunk_bytes", 1.5, "an integer"),
        ("eager_bytes", True, "an integer"),
        ("heartbeat_s", float("inf"), "a finite number"),
        ("shm_max_bytes", -5, ">= 0"),
    ]:
        with pytest.raises(ValueError, match=says):
            FreescaleOptions(**{field: value})
    # A whole number of seconds and the same from the environment are one setting on every rank
    # (they compare as text at set-up: 30 against 30.0 failed it).
    monkeypatch.setenv("FREESCALE_DEAD_AFTER_S", "30")
    assert "dead_after_s=30.0" in FreescaleOptions.from_env().shared()
    assert "dead_after_s=30.0" in FreescaleOptions(dead_after_s=30).shared()


def test_a_misspelt_option_variable_is_warned_of(monkeypatch, caplog):
    monkeypatch.setenv("FREESCALE_EAGER_BYTE", "0")
    monkeypatch.setenv("FREESCALE_KERNELS_BACKEND", "torch")  # another package's: no warning
    with caplog.at_level("WARNING", logger="freescale_comm.options"):
        assert FreescaleOptions.from_env().eager_bytes == FreescaleOptions().eager_bytes
    assert [r.getMessage() for r in caplog.records] == [
        "FREESCALE_EAGER_BYTE is not an option of the freescale backend (FREESCALE_EAGER_BYTES?)"
    ]


def test_auto_copy_helpers_only_where_each_rank_has_two_cores_or_more():
    assert helper_threads(0, host_ranks=2, cores=2) == 1  # the CI machine: copies stay put
    assert helper_threads(0, host_ranks=4, cores=2) == 1
    assert helper_threads(0, host_ranks=2, cores=5) == 2
    assert helper_threads(0, host_ranks=2, cores=16) == 8
    assert helper_threads(0, host_ranks=1, cores=64) == 8  # at most AUTO_MAX_THREADS
    assert helper_threads(3, host_ranks=2, cores=2) == 3  # the option wins
    with pytest.raises(ValueError, match="host_copy_threads"):
        FreescaleOptions(host_copy_threads=65)


def test_own_pieces_are_split_into_jobs_of_2_mib_or_more_covering_every_byte():
    mib = 1 << 20
    src = [np.arange(n, dtype=np.uint64).view(np.uint8) for n in (5 * mib // 8, 7 * mib // 8)]
    dst = [np.zeros_like(s) for s in src]
    jobs = split(list(zip(dst, src, strict=True)), threads=8)
    assert len(jobs) == 6  # 5 + 7 MiB: six jobs of 2 MiB, one crossing the two copies
    assert all(sum(len(d) for d, _ in job) == 2 * mib for job in jobs)
    for job in jobs:
        for d, s in job:
            d[:] = s
    assert all(np.array_equal(d, s) for d, s in zip(dst, src, strict=True))
    assert len(split([(dst[0][:1000], src[0][:1000])], threads=8)) == 1  # small: one job


def test_jobs_the_pool_refuses_run_on_the_calling_thread(monkeypatch):
    # After the interpreter's shutdown began the pool refuses new jobs: the one it took still
    # runs on a helper, the others here, and every byte is copied (or every part read).
    from concurrent.futures import ThreadPoolExecutor

    from freescale_comm import local_copies

    real = ThreadPoolExecutor(1)

    class RefusesAfterOne:
        taken = 0

        def submit(self, fn, *args):
            if self.taken:
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            self.taken += 1
            return real.submit(fn, *args)

    monkeypatch.setattr(local_copies, "_shared_pool", RefusesAfterOne)
    src = np.arange(16 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    copies = LocalCopies(threads=4, wake=lambda: None)
    pending = copies.start([(dst, src)])
    pending.wait()
    assert np.array_equal(dst, src) and copies.jobs == 1
    refusing = RefusesAfterOne()
    monkeypatch.setattr(local_copies, "_reader_pool", lambda threads: refusing)
    here = threading.current_thread().name
    [futures] = start_reads(
        [(lambda a, b: (a, b, threading.current_thread().name), 16 << 20, 4)], lambda: None
    )
    parts = [future.result() for future in futures]
    assert [part[:2] for part in parts] == [(k << 22, (k + 1) << 22) for k in range(4)]
    assert [part[2] == here for part in parts] == [False, True, True, True]
    real.shutdown()
    _until(lambda: not local_copies.helpers_busy())  # the refused jobs were never counted


def _until(condition, seconds: float = 5.0) -> None:
    """Waits (bounded) for ``condition``, which a pool thread makes true just after a future
    it completed is seen done (its callbacks run after the waiters wake)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_helpers_are_busy_while_a_job_is_queued_or_running():
    from freescale_comm.local_copies import helpers_busy

    release = threading.Event()
    here = threading.current_thread().name

    def part(start: int, end: int) -> None:
        if threading.current_thread().name != here:
            release.wait(10)

    [futures] = start_reads([(part, 8 << 20, 2)], wake=lambda: None)
    assert helpers_busy() and not futures[0].done()  # the first part waits on a reader thread
    release.set()
    futures[0].result(timeout=10)
    _until(lambda: not helpers_busy())


def test_a_part_the_pool_queued_but_refused_runs_once(monkeypatch):
    # Python's pool queues a job before it starts a thread for it; where no thread could be
    # started, submit raises with the job queued, and a busy thread of the pool may run it
    # after the caller did: a second read into an output already counted done.
    from concurrent.futures import ThreadPoolExecutor

    from freescale_comm import local_copies

    real = ThreadPoolExecutor(1)

    class QueuesThenRefuses:
        def submit(self, fn, *args):
            real.submit(fn, *args)
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(local_copies, "_reader_pool", lambda threads: QueuesThenRefuses())
    runs = []
    [futures] = start_reads([(lambda a, b: runs.append((a, b)), 8 << 20, 2)], lambda: None)
    real.shutdown(wait=True)  # the queued copies have run (or been skipped) by now
    assert all(f.done() for f in futures) and sorted(runs) == [(0, 4 << 20), (4 << 20, 8 << 20)]


def test_reads_start_at_once_in_parts_the_last_one_here_and_helpers_wake_as_they_end():
    seen, woken = [], []
    here = threading.current_thread().name
    release = threading.Event()

    def part(start: int, end: int) -> int:
        if threading.current_thread().name != here:
            release.wait(10)  # helpers' parts are still running when start_reads returns
        seen.append((start, end, threading.current_thread().name))
        return end - start

    sizes = [(17 << 20) + 5, 1 << 20]  # a message cut into 4 parts, then a small one
    reads = start_reads([(part, n, 4) for n in sizes], wake=lambda: woken.append(1))
    assert [len(futures) for futures in reads] == [4, 1]
    assert reads[1][0].done() and not any(f.done() for f in reads[0])  # the last part: here
    release.set()
    assert [sum(f.result(timeout=10) for f in futures) for futures in reads] == sizes
    first = sorted((a, b) for a, b, name in seen if b - a > (1 << 20))
    assert first[0][0] == 0 and first[-1][1] == sizes[0]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(first))
    assert sum(name.startswith("freescale-read") for *_, name in seen) == 4
    _until(lambda: len(woken) >= 4)  # one per helper's part
    assert len(woken) == 4


def test_local_copies_run_on_helpers_from_2_mib_and_wake_the_progressing_thread():
    woken = []
    src = np.arange(12 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    copies = LocalCopies(threads=3, wake=lambda: woken.append(1))
    small = (2 << 20) - 1
    assert copies.start([(dst[:small], src[:small])]) is None  # small: copied here, at once
    assert np.array_equal(dst[:small], src[:small]) and not woken
    pending = copies.start([(dst, src)])
    pending.wait()
    assert pending.done() and pending.error() is None and np.array_equal(dst, src)
    _until(lambda: len(woken) >= 3)  # one wake-up per job, from its thread
    assert len(woken) == 3
    whole = 2 << 20  # the least that goes to a helper (one job)
    jobs = copies.jobs
    copies.start([(dst[:whole], src[:whole])]).wait()
    assert copies.jobs == jobs + 1
    assert LocalCopies(threads=1, wake=lambda: None).start([(dst, src)]) is None


class _Clock:
    """The ``time`` module with a ``perf_counter`` that moves only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def test_a_poller_sleeps_once_its_yields_keep_finding_no_other_thread_where_ranks_outnumber_cores():
    from freescale_comm import engine

    assert alone_yields(host_ranks=4, cores=2) == ALONE_YIELDS
    assert alone_yields(host_ranks=2, cores=2) == 0  # a core per rank: polling alone is the plan
    # A yield that returns at once, and one another thread's turn delays, on a clock of the
    # test's own: on the real clock a busy CI machine delayed an "alone" yield now and then.
    clock = _Clock()

    def shared() -> None:
        clock.now += 1e-3

    results = {}
    for name, yields in (("alone", lambda: None), ("shared", shared)):
        with (
            mock.patch.object(engine.os, "sched_yield", yields),
            mock.patch.object(engine, "time", clock),
        ):
            results[name] = [engine.yield_core(ALONE_YIELDS) for _ in range(2 * ALONE_YIELDS)]
            results[name + " no limit"] = all(engine.yield_core(0) for _ in range(ALONE_YIELDS))
    # Alone: told to sleep at the limit, then counted again from zero.
    assert results["alone"].count(False) == 2 and not results["alone"][ALONE_YIELDS - 1]
    assert all(results["shared"]) and results["alone no limit"] and results["shared no limit"]


def test_auto_idle_wait_polls_long_only_where_the_hosts_ranks_outnumber_its_cores():
    assert idle_poll_s("auto", host_ranks=4, cores=2) == YIELD_S
    assert idle_poll_s("auto", host_ranks=2, cores=2) == POLL_S < YIELD_S
    assert idle_poll_s("yield", host_ranks=1, cores=16) == YIELD_S
    assert idle_poll_s("sleep", host_ranks=8, cores=1) == 0.0
    assert FreescaleOptions().idle_wait == "auto"


def _cgroup_tree(root, cgroup_lines, files):
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text("\n".join(cgroup_lines) + "\n")
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return str(root)


def test_cpu_quota_of_cgroups_caps_the_usable_cores(tmp_path):
    # v2: the tightest quota of the process's cgroup and those above it.
    v2 = _cgroup_tree(
        tmp_path / "v2",
        ["0::/pod/rank"],
        {
            "sys/fs/cgroup/cpu.max": "max 100000",
            "sys/fs/cgroup/pod/cpu.max": "150000 100000",
            "sys/fs/cgroup/pod/rank/cpu.max": "400000 100000",
        },
    )
    assert cgroup_cpu_quota(v2) == 1.5
    assert usable_cores(v2) == min(2, len(os.sched_getaffinity(0)))
    # v1 (inside a container the mount's root is the container's cgroup, whatever the path).
    v1 = _cgroup_tree(
        tmp_path / "v1",
        ["12:cpu,cpuacct:/docker/abc", "1:name=systemd:/docker/abc"],
        {
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "50000\n",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cgroup_cpu_quota(v1) == 0.5
    assert usable_cores(v1) == 1
    unlimited = _cgroup_tree(
        tmp_path / "none",
        ["0::/", "3:cpu:/", "not a cgroup line"],
        {
            "sys/fs/cgroup/cpu.max": "max 100000",
            "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1",
            "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000",
        },
    )
    assert cgroup_cpu_quota(unlimited) is None
    assert cgroup_cpu_quota(str(tmp_path / "no-proc")) is None
    assert usable_cores(unlimited) == len(os.sched_getaffinity(0))


def test_tags_are_distinct_per_field():
    base = make_tag(3, 7, 1, 2)
    others = {
        make_tag(4, 7, 1, 2),
        make_tag(3, 8, 1, 2),
        make_tag(3, 7, 2, 2),
        make_tag(3, 7, 1, 3),
    }
    assert base not in others and len(others) == 4
    assert make_tag(3, 7 + (1 << 20), 1, 2) == base  # the sequence number wraps
    with pytest.raises(Exception, match="does not fit"):
        make_tag(0, 0, 0, MAX_SUB + 1)


def _sig(send, recv, **kw):
    fields = {"op": "all_to_all", "dtype": "torch.float32", "device": "cpu", "count": 1}
    fields.update(kw)
    return Signature(send_bytes=send, recv_bytes=recv, **fields)


def test_signature_round_trip_and_verdicts():
    sig = _sig([1, 2, 3], [4, 5, 6], error="x" * 500)
    back = Signature.decode_table(sig.encode_table(3), 3)
    assert back.send_bytes == (1, 2, 3) and back.recv_bytes == (4, 5, 6)
    assert back.error.startswith("xxx") and back.dtype == "torch.float32"
    short = Signature.decode(sig.encode(3), 3)
    assert short.error == back.error and short.dtype == back.dtype
    good = [_sig([0, 8], [0, 4]), _sig([4, 0], [8, 0])]
    assert verdict(good) is None
    bad = [_sig([0, 8], [0, 4]), _sig([4, 0], [4, 0])]
    assert "rank 0 sends 8 bytes to rank 1, which expects 4" in verdict(bad)
    mixed = [_sig([0], [0]), _sig([0], [0], dtype="torch.int64")]
    assert "rank 1 has dtype torch.int64" in verdict(mixed)
    assert Signature.decode(good[0].encode(2), 2).op == "all_to_all"  # from the table of ops
    other = _sig([0], [0], op="not_a_collective")
    assert Signature.decode(other.encode(1), 1).op.startswith("<unknown collective, code 0x")


def test_an_error_cut_by_the_header_says_so_and_its_own_rank_raises_it_whole():
    # A split-size error in a 32-rank group lost its end (what is wrong) on every rank.
    own = "all_to_all_single input split sizes add up to 131071, not 131072: " + str([4096] * 32)
    problem = verdict([_sig([0], [0]), Signature.decode(_sig([0], [0], error=own).encode(2), 2)])
    assert problem.startswith("rank 1: all_to_all_single input split sizes add up to 131071")
    assert problem.endswith("[...] (cut; the whole message is in that rank's own error)")
    assert with_own_error(problem, 1, own) == f"rank 1: {own}"
    assert with_own_error(problem, 0, "") == problem
    # Another rank whose error starts alike keeps the verdict's (rank 1's, as every rank).
    assert with_own_error(problem, 0, own[:-1] + "9]") == problem
    # Exactly the field's length: not cut, not marked.
    full = "x" * 200
    exact = verdict([Signature.decode(_sig([0], [0], error=full).encode(1), 1)])
    assert exact == f"rank 0: {full}" and with_own_error(exact, 0, full) == exact


def test_a_header_says_whether_its_sender_took_the_ipc_path():
    # Its messages to peers of its host then carry a descriptor, with a pushed mailbox slot
    # that even a receiver off the IPC path must free after a bad verdict.
    by_device = {
        device: names_ipc(_sig([0, 8], [0, 8], device=device).encode(2))
        for device in ("cpu", "cuda", "cuda-staged", "cuda-ipc+direct", "cuda-ipc+staged")
    }
    assert by_device == {
        "cpu": False,
        "cuda": False,
        "cuda-staged": False,
        "cuda-ipc+direct": True,
        "cuda-ipc+staged": True,
    }


def test_a_message_split_differently_is_rejected():
    # Two tensors per message: rank 0 sends 8+12 bytes, rank 1 sends 12+8; each rank lists what
    # it expects from rank 0, then from rank 1.
    def side(sends, expects):
        return _sig(
            [20, 20],
            [20, 20],
            op="all_gather",
            count=2,
            send_layout=layout(sends),
            recv_layouts=[layout(e) for e in expects],
        )

    rank0 = side([8, 12], [[8, 12], [12, 8]])
    rank1 = side([12, 8], [[8, 12], [12, 8]])
    assert verdict([rank0, rank1]) is None
    assert judge([s.encode(2) for s in (rank0, rank1)], 2) is None
    wrong = side([8, 12], [[8, 12], [12, 8]])  # rank 1 now sends 8+12
    assert judge([s.encode(2) for s in (rank0, wrong)], 2) is NEEDS_TABLE
    problem = judge_table([s.encode_table(2) for s in (rank0, wrong)], 2)
    assert "rank 1 sends rank 0 the same bytes split into tensors of other sizes" in problem
    back = Signature.decode_table(wrong.encode_table(2), 2)
    assert back.send_layout == wrong.send_layout
    assert list(back.recv_layouts) == list(wrong.recv_layouts)


def test_import_is_cheap_and_registers():
    # What torch's entry point does: no ucxx, numpy or backend machinery imported.
    code = (
        "import sys, torch, torch.distributed as dist, freescale_comm;"
        "assert 'FREESCALE' in dist.Backend._plugins;"
        "assert dist.is_backend_available('freescale');"
        "heavy = [m for m in ('ucxx', 'freescale_comm.process_group') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# torch and the ``freescale`` command find the backend through the installed distribution's
# entry points; a tree on PYTHONPATH alone (the GPU machine's device calls) has none.
requires_installed_entry_points = pytest.mark.skipif(
    not any(
        point.value == "freescale_comm:_autoload" for point in entry_points(group="torch.backends")
    ),
    reason="freescale-comm is not installed: no entry points",
)


@requires_installed_entry_points
def test_torch_entry_point_registers_after_plain_import_torch():
    code = "import torch.distributed as dist; assert 'FREESCALE' in dist.Backend._plugins"
    subprocess.run([sys.executable, "-c", code], check=True)


@requires_installed_entry_points
def test_comm_info_command():
    out = subprocess.run(
        [sys.executable, "-m", "freescale_comm._freescale_cli", "comm", "info"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "UCX 1." in out and "transports:" in out


def test_every_collective_torchs_trampoline_intercepts_is_overridden():
    # torch's PyProcessGroup runs these through its trampoline; one a Python subclass leaves to
    # the C++ base runs with the GIL held and can deadlock Gloo / NCCL (process_group's docstring).
    import torch.distributed as dist

    from freescale_comm.process_group import ProcessGroupFreescale

    # torch 2.13's names, then 2.11's for the same methods; a name this torch's ProcessGroup
    # lacks is one its trampoline cannot call either.
    trampolined = [
        "allgather",
        "all_gather_single_coalesced",
        "allreduce",
        "allreduce_coalesced",
        "all_to_all_single",
        "barrier",
        "broadcast",
        "reduce_scatter",
        "reduce_scatter_single_coalesced",
        "send",
        "recv",
        "allgather_into_tensor_coalesced",
        "reduce_scatter_tensor_coalesced",
        "alltoall_base",
        "_allgather_base",
    ]
    present = [name for name in trampolined if hasattr(dist.ProcessGroup, name)]
    assert len(present) >= 10
    missing = [name for name in present if name not in vars(ProcessGroupFreescale)]
    assert missing == []


def test_own_piece_already_in_place_is_not_copied():
    import torch

    from freescale_comm import algorithms

    n, rank = 4, 1
    out = torch.zeros(n * 6)
    for allgather in ("direct", "ring"):
        options = FreescaleOptions(allgather=allgather, ring_threshold_bytes=1)
        in_place = algorithms.all_gather_into_tensor(
            "ag", rank, n, [out], [out.view(n, 6)[rank]], options
        )
        apart = algorithms.all_gather_into_tensor("ag", rank, n, [out], [torch.ones(6)], options)
        assert in_place.local_copies == [] and len(apart.local_copies) == 1


def _described(plan):
    return (
        [
            (t.peer, t.sub, t.send, t.chunk, bytes(t.buffer), t.after is not None)
            for t in plan.transfers
        ],
        [(bytes(d), bytes(s)) for d, s in plan.local_copies],
        plan.signature,
        plan.forwarding,
    )


@pytest.mark.parametrize("allgather", ["direct", "ring"])
def test_a_cached_plan_is_the_plan_that_would_be_built(allgather):
    from freescale_comm import algorithms

    options = FreescaleOptions(allgather=allgather, chunk_bytes=8)
    n, rank = 4, 1
    cache = algorithms.PlanCache()
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        inp = torch.randint(0, 100, (10, 3), generator=gen)
        out = torch.empty(10, 3, dtype=torch.int64)
        splits_in, splits_out = [1, 2, 3, 4], [3, 2, 4, 1]
        for _ in range(2):
            cached = algorithms.all_to_all_single(
                "a2a", rank, n, out, inp, splits_out, splits_in, cache
            )
            built = algorithms.all_to_all_single("a2a", rank, n, out, inp, splits_out, splits_in)
            assert _described(cached) == _described(built)
        assert cached.template is not None
        moved = inp + 1  # alive beside ``inp``: at another address, the template's buffers too
        cached = algorithms.all_to_all_single(
            "a2a", rank, n, out, moved, splits_out, splits_in, cache
        )
        built = algorithms.all_to_all_single("a2a", rank, n, out, moved, splits_out, splits_in)
        assert _described(cached) == _described(built)
        x = torch.randn(5, generator=gen)
        gathered = torch.empty(n * 5)
        for _ in range(2):
            cached = algorithms.all_gather_into_tensor(
                "ag", rank, n, [gathered], [x], options, cache
            )
            built = algorithms.all_gather_into_tensor("ag", rank, n, [gathered], [x], options)
            assert _described(cached) == _described(built)
        assert cached.template is not None


def test_strided_overlapping_and_bad_calls_are_not_cached():
    from freescale_comm import algorithms

    options = FreescaleOptions()
    cache = algorithms.PlanCache()
    out = torch.empty(8)
    for _ in range(2):  # in place: the input is this rank's slot of the output
        plan = algorithms.all_gather_into_tensor("ag", 1, 2, [out], [out[4:]], options, cache)
        assert plan.template is None and not plan.local_copies
    strided = torch.empty(4, 2).t()
    for _ in range(2):
        plan = algorithms.all_to_all_single("a2a", 0, 2, torch.empty(2, 4), strided, [], [], cache)
        assert plan.template is None
        plan = algorithms.all_to_all_single(
            "a2a", 0, 2, torch.empty(4), torch.empty(4), [], [5, -1], cache
        )
        assert plan.template is None and "negative" in plan.signature.error


@pytest.mark.parametrize("n", [1, 2, 3, 64, 1000])
def test_fixed_size_headers_find_any_one_wrong_entry(n):
    import random

    rng = random.Random(n)
    table = [[rng.getrandbits(40) for _ in range(n)] for _ in range(n)]
    sigs = [_sig(table[r], [table[s][r] for s in range(n)]) for r in range(n)]
    # Each rank's headers, encoded once: a wrong entry changes only its own rank's headers.
    headers = [s.encode(n) for s in sigs]
    tables = [s.encode_table(n) for s in sigs]
    assert len({len(h) for h in headers}) == 1
    assert Signature.size(n) == Signature.size(2) == len(headers[0])
    assert judge(headers, n) is None
    for _ in range(5):  # one entry off by one, on the sending or on the receiving side
        r, p = rng.randrange(n), rng.randrange(n)
        sends, recvs = list(sigs[r].send_bytes), list(sigs[r].recv_bytes)
        (sends if rng.random() < 0.5 else recvs)[p] += 1
        bad = _sig(sends, recvs)
        bad_headers, bad_tables = list(headers), list(tables)
        bad_headers[r], bad_tables[r] = bad.encode(n), bad.encode_table(n)
        assert judge(bad_headers, n) is NEEDS_TABLE
        problem = judge_table(bad_tables, n)
        assert "sizes or split sizes disagree" in problem
    # The same table held by other ranks (rows swapped) is caught too.
    if n > 2:
        swapped = [headers[1], headers[0], *headers[2:]]
        assert judge(swapped, n) is not None


@pytest.mark.parametrize("n", [1, 2, 5, 11])
def test_small_groups_digest_and_judge_on_ints_as_numpy_does(n, monkeypatch):
    # Groups under validation._NUMPY_FROM_RANKS ranks compute on Python ints: the same header
    # bytes and the same verdicts as the numpy path every larger group takes.
    import random

    from freescale_comm import validation

    rng = random.Random(n)
    table = [[rng.getrandbits(40) for _ in range(n)] for _ in range(n)]
    sigs = [_sig(table[r], [table[s][r] for s in range(n)]) for r in range(n)]
    layouts = Signature(
        op="all_gather",
        dtype="torch.float32",
        device="cpu",
        count=2,
        send_bytes=[12] * n,
        recv_bytes=[12] * n,
        send_layout=layout([4, 8]),
        recv_layouts=[layout([4, 8])] * n,
    )
    wrong = list(sigs)
    wrong[n - 1] = _sig([b + 1 for b in table[n - 1]], [table[s][n - 1] for s in range(n)])
    failing = [*sigs[:-1], _sig(table[n - 1], [0] * n, error="a2a bad input")]
    cases = [sigs, wrong, failing, [layouts] * n]

    def run() -> tuple[list[bytes], list[Any]]:
        encoded = [[s.encode(n) for s in case] for case in cases]
        return [h.tobytes() for case in encoded for h in case], [judge(h, n) for h in encoded]

    ints = run()
    monkeypatch.setattr(validation, "_NUMPY_FROM_RANKS", 0)
    assert run() == ints
    assert ints[1][0] is None and ints[1][3] is None
    assert ints[1][1] is NEEDS_TABLE and "bad input" in ints[1][2]


def test_a_disagreement_in_a_large_group_is_named_in_few_words():
    sigs = [_sig([0], [0], dtype="torch.int64")] + [_sig([0], [0])] * 999
    sigs[500] = _sig([0], [0], dtype="torch.int64")
    assert verdict(sigs) == (
        "ranks disagree: ranks 0, 500 have dtype torch.int64, "
        "ranks 1-499, 501-999 have dtype torch.float32"
    )


def test_ipc_descriptors_round_trip_and_refuse_a_wrong_count():
    from freescale_comm import ipc

    pieces = [(bytes(range(64)), 5, 7), (bytes(64), 1 << 40, 11)]
    gpu, mailbox = bytes(range(100, 116)), bytes(range(1, 65))
    room = np.full(1000, 255, dtype=np.uint8)  # a header's room: the descriptor, then garbage
    message = ipc.encode(gpu, mailbox, 2, pieces)
    room[: len(message)] = message
    got = ipc.decode(room, 2)
    assert (got.gpu, got.mailbox, got.slot) == (gpu, mailbox, 2)
    assert [(p.handle, p.offset, p.nbytes) for p in got.pieces] == pieces
    assert ipc.pushed_slot(room) == 2
    with pytest.raises(FreescaleError, match="names 2 pieces, 3 expected"):
        ipc.decode(room, 3)
    pulled = ipc.encode(gpu, mailbox, -1, [])
    assert ipc.decode(pulled, 0) == ipc.Descriptor(gpu, mailbox, -1, [])
    assert ipc.pushed_slot(pulled) == -1 and ipc.pushed_slot(pulled[:10]) == -1
    # A slot a mailbox does not have is not one the receiver frees.
    assert ipc.pushed_slot(ipc.encode(gpu, mailbox, ipc.MAILBOX_SLOTS, [])) == -1
    assert ipc.pieces_in(96 + 80 * 3 + 79) == 3 and ipc.pieces_in(0) == 0


def test_device_bytes_slice_like_flat_bytes():
    from freescale_comm.algorithms import DeviceBytes, address

    flat, host = DeviceBytes(4096, 100), np.arange(100)
    for span in (slice(10, 20), slice(90, 200), slice(None, 30), slice(50, 40)):
        got, want = flat[span], host[span]
        assert len(got) == len(want)
        if len(want):
            assert address(got) == 4096 + int(want[0])


def test_completion_wakes_a_waiter_on_another_thread():
    import threading

    from freescale_comm.collective import _Done

    done = _Done()
    assert not done.is_set() and not done.wait(0.01)  # times out while unset
    setter = threading.Timer(0.05, done.set)
    setter.start()
    assert done.wait(10)  # blocked in a real Event until the other thread set it
    setter.join()
    assert done.is_set() and done.wait(0)
    already = _Done()
    already.set()
    assert already.wait(0)  # set before anyone waited: no Event made
    assert already._event is None


def _done_future(value: Any, runner: Any) -> Any:
    from freescale_comm.futures import CollectiveFuture

    future = CollectiveFuture(runner)
    future.complete(True, value)
    return future


def test_callbacks_run_off_the_completing_thread_in_the_order_attached():
    from freescale_comm.futures import CallbackRunner, CollectiveFuture

    runner = CallbackRunner(None)
    ran: list[tuple[str, str]] = []
    first, second = CollectiveFuture(runner), CollectiveFuture(runner)
    chained = [
        future.then(lambda f, name=name: ran.append((name, threading.current_thread().name)))
        for future, name in ((first, "first"), (second, "second"))
    ]
    second.complete(True, ["b"])  # done first, attached second: waits for the first
    time.sleep(0.2)
    assert ran == [] and second.done()  # done as soon as completed: only its callback waits
    first.complete(False, FreescaleError("first failed"))
    torch.futures.wait_all(chained)
    assert [name for name, _ in ran] == ["first", "second"]
    assert {thread for _, thread in ran} == {"freescale-comm-callbacks"}
    # The chained futures are done inside the last callback, before the callback thread counts
    # itself idle (under load that took long enough for the next attach to queue behind it).
    idle_by = time.monotonic() + 5
    while runner._running is not None and time.monotonic() < idle_by:
        time.sleep(0.001)
    # Attached to a done future with nothing waiting or running: at once, in this thread.
    late = _done_future([3], runner).then(lambda f: threading.current_thread().name)
    assert late.done() and late.value() == threading.current_thread().name
    runner.close(timeout_s=5)


def test_a_callback_may_wait_for_a_later_future_and_attach_callbacks():
    from freescale_comm.futures import CallbackRunner, CollectiveFuture

    runner = CallbackRunner(None)
    first, later = CollectiveFuture(runner), CollectiveFuture(runner)

    def waits_for_later(_: torch.futures.Future) -> int:
        # On the callback thread: a callback attached here runs at once, in order.
        return later.wait()[0] + later.then(lambda f: f.value()[0]).wait()

    chained = first.then(waits_for_later)
    first.complete(True, [0])
    time.sleep(0.1)
    later.complete(True, [21])
    waiter = threading.Thread(target=chained.wait, daemon=True)
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive() and chained.value() == 42
    thread = runner._thread
    runner.close(timeout_s=5)
    assert thread is not None and not thread.is_alive()  # this runner's (another test's may live)


def test_a_callback_attached_while_another_runs_waits_for_it():
    # Attached to a done future while the callback thread ran another: it ran at once, beside
    # it, and the nested collectives of the two paired up differently on each rank.
    from freescale_comm.futures import CallbackRunner, CollectiveFuture

    runner = CallbackRunner(None)
    release, ran = threading.Event(), []

    def first_callback(_: torch.futures.Future) -> None:
        ran.append("first started")
        release.wait(10)
        ran.append("first ended")

    first = CollectiveFuture(runner)
    first.then(first_callback)  # queued: it runs on the callback thread once done
    first.complete(True, [1])
    deadline = time.monotonic() + 10
    while ran != ["first started"] and time.monotonic() < deadline:
        time.sleep(0.01)
    second = _done_future([2], runner).then(lambda _: ran.append("second"))
    time.sleep(0.2)
    assert ran == ["first started"]
    release.set()
    second.wait()
    assert ran == ["first started", "first ended", "second"]
    runner.close(timeout_s=5)


def _in_thread(fn: Any, timeout_s: float = 10) -> Any:
    """``fn()`` on a thread of its own; fails the test if it does not return in time."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert out, f"did not return within {timeout_s} s"
    return out[0]


def test_a_running_callback_may_attach_to_futures_and_wait_for_them():
    # Attached inside a callback running inline, the nested callback was queued behind the one
    # waiting for it: a hang.
    from freescale_comm.futures import CallbackRunner, CollectiveFuture

    runner = CallbackRunner(None)
    done, pending = _done_future([2], runner), CollectiveFuture(runner)

    def outer(_: torch.futures.Future) -> int:
        # A done future's callback, and one whose future completes a moment later.
        threading.Timer(0.2, lambda: pending.complete(True, [3])).start()
        first = done.then(lambda f: f.value()[0] * 10)
        second = pending.then(lambda f: f.value()[0] * 100)
        return first.wait() + second.wait()

    assert _in_thread(lambda: _done_future([1], runner).then(outer).wait()) == 320
    runner.close(timeout_s=5)


def test_a_failing_callback_fails_thens_future_as_torchs_then_does():
    from freescale_comm.futures import CallbackRunner

    runner = CallbackRunner(None)
    plain: torch.futures.Future = torch.futures.Future()
    plain.set_result([1])
    raised = []
    for future in (_done_future([1], runner), plain):
        with pytest.raises(Exception) as err:
            future.then(lambda _: 1 / 0).wait()
        raised.append((type(err.value), str(err.value).splitlines()[0]))
    assert raised[0] == raised[1], raised
    runner.close(timeout_s=5)


def test_an_outbox_reads_its_peers_counters_again_after_raising_its_wake_flag():
    # A peer that consumed between the first read and the flag's store read the flag as 0
    # and sent no wake-up: the writer must see the counter on its second read, not sleep.
    from freescale_comm import outbox

    class _PeerCounters:  # the peer's control block: "consumed" moves after the first read
        def __init__(self) -> None:
            self.reads = 0

        def __getitem__(self, index: int) -> int:
            assert index == outbox._CONSUMED
            self.reads += 1
            return 3 if self.reads == 1 else 4

    class _Segment:
        def __init__(self, ctrl: Any) -> None:
            self.ctrl = ctrl

    boxes = outbox.Outboxes.__new__(outbox.Outboxes)
    own = [0] * 3 * 8
    peer = _PeerCounters()
    boxes._own, boxes._peers, boxes._posted = _Segment(own), {1: _Segment(peer)}, 5
    assert boxes.writable(6) and peer.reads == 2
    assert own[outbox._WANTS_CONSUMED] == 0  # lowered again: no wake-up owed


def test_a_wait_for_readers_raises_its_wake_flag_for_good_and_reads_again_once():
    # A reader that consumed between the first read and the flag's store read the flag as 0
    # and sent no wake-up: the sender must see the counter on its second read. The flag then
    # stays raised (several threads may wait for readers at once; none lowers it), so a later
    # wait reads the counters once.
    from freescale_comm import outbox

    class _PeerCounters:  # the reader's control block: "consumed" moves after the first read
        def __init__(self, values: list[int]) -> None:
            self.values, self.reads = values, 0

        def __getitem__(self, index: int) -> int:
            assert index == outbox._CONSUMED
            self.reads += 1
            return self.values[min(self.reads, len(self.values)) - 1]

    class _Segment:
        def __init__(self, ctrl: Any) -> None:
            self.ctrl = ctrl

    boxes = outbox.Outboxes.__new__(outbox.Outboxes)
    own = [0] * 5 * 8
    reader, other = _PeerCounters([3, 4]), _PeerCounters([0])  # ``other`` reads nothing
    boxes._own, boxes._peers = _Segment(own), {1: _Segment(reader), 2: _Segment(other)}
    assert boxes.reads_done(4, [1]) and reader.reads == 2 and other.reads == 0
    assert own[outbox._WANTS_READS_DONE] == 1 and own[outbox._WANTS_CONSUMED] == 0
    later = _PeerCounters([4])
    boxes._peers[1] = _Segment(later)
    assert not boxes.reads_done(5, [1]) and later.reads == 1
    assert own[outbox._WANTS_READS_DONE] == 1
    assert outbox._waits_for_consumed(boxes._own)


def test_an_aborted_group_releases_its_ipc_waits_again_each_second_until_they_drain():
    # A live peer's GPU may write a flag of a collective it queued before the abort after
    # this rank released its waits, setting the flag back below a wait still queued here.
    from freescale_comm.group import GroupContext
    from freescale_comm.ipc import IpcPath

    class _Path:  # what the upkeep and ``keep_released`` call of an IPC path
        def __init__(self) -> None:
            self.releases = 0
            self.queued = True

        def drained(self) -> bool:
            return not self.queued

        def release(self) -> None:
            self.releases += 1

        def keep_released(self) -> None:
            IpcPath.keep_released(self)

    ctx = GroupContext.__new__(GroupContext)
    path = _Path()
    ctx._timeout_source, ctx._broken, ctx._ipc, ctx.timeout_s = None, None, {0: path}, 60.0
    ctx._gloo_waits, ctx._gloo_polls = {}, {}  # no wait on Gloo in progress
    ctx._upkeep()
    assert path.releases == 0  # a healthy group's waits are met by its peers
    ctx._broken = "rank 1 died"
    ctx._upkeep()
    ctx._upkeep()
    assert path.releases == 2
    path.queued = False
    ctx._upkeep()
    assert path.releases == 2  # drained: nothing left to release


def test_the_signature_names_a_coalesced_all_gathers_dtypes_in_order():
    from freescale_comm.algorithms import _dtypes_name
    from freescale_comm.validation import DTYPE_NAME_BYTES

    def name(*dtypes: torch.dtype) -> str:
        return _dtypes_name([torch.empty(1, dtype=d) for d in dtypes])

    assert name(torch.float32, torch.float32) == ""  # one dtype: its own name is used
    assert name(torch.int64, torch.float16) == "int64+float16"
    assert name(torch.float16, torch.int64) != name(torch.int64, torch.float16)
    many = [torch.float32, torch.int64] * 6
    long_name = name(*many)  # too long for the field: a digest of the whole list
    assert long_name.startswith("mixed ") and len(long_name) <= DTYPE_NAME_BYTES
    assert long_name == name(*many) and long_name != name(*many[:-1], torch.int32)


def test_an_all_gathers_outputs_must_have_their_inputs_dtype():
    from freescale_comm import algorithms
    from freescale_comm.options import FreescaleOptions

    options = FreescaleOptions()
    f64 = torch.float64

    def error_of(plan: Any) -> str:
        return plan.signature.error

    plain = algorithms.all_gather_into_tensor(
        "all_gather_into_tensor", 0, 2, [torch.empty(4, dtype=f64)], [torch.ones(2)], options
    )
    assert "the input has dtype torch.float32 but an output for it torch.float64" in error_of(plain)
    listed = algorithms.all_gather(
        "all_gather", 0, 2, [[torch.empty(2), torch.empty(2, dtype=f64)]], [torch.ones(2)], options
    )
    assert "but an output for it torch.float64" in error_of(listed)
    mixed = algorithms.all_gather_into_tensor(
        "all_gather_into_tensor_coalesced",
        0,
        2,
        [torch.empty(4), torch.empty(2, dtype=torch.int64)],
        [torch.ones(2), torch.ones(1, dtype=torch.int64)],
        options,
    )
    assert error_of(mixed) == "" and mixed.signature.dtype == "float32+int64"
    # A plan that cannot be built names that, not the dtypes it mixes.
    unreadable = algorithms._planned(
        None, "op", [torch.ones(1), torch.ones(1, dtype=f64)], 0, [], 2, lambda: 1 / 0
    )
    assert "cannot read its tensors: ZeroDivisionError" in error_of(unreadable)


def test_gated_pulls_queue_each_peer_once_the_cpu_sees_its_flag(monkeypatch):
    # On a GPU shared with a peer, no queued wait may spin through a time slice: each pull is
    # queued once the CPU sees the peer's ready flag, and the collective ends once it sees
    # every reader's "read" (``ipc.GatedPulls``). Flags and driver calls stand in here.
    import threading

    from freescale_comm import ipc

    queued: list[tuple] = []

    class _Ops:  # records what ``IpcPath.advance`` queues, in order, when it runs
        def __init__(self) -> None:
            self._calls: list[tuple] = []

        def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
            self._calls.append(("copy", dst, src, nbytes))

        def write(self, stream: int, flag: int, value: int) -> None:
            self._calls.append(("write", flag, value))

        def run(self, device: int) -> None:
            queued.extend(self._calls)

    class _PairFlags:
        def __init__(self, peer: int) -> None:
            self.my_done, self.ready, self.done = 1000 + peer, 0, 0

        def sees_ready(self, seq: int) -> bool:
            return self.ready >= seq

        def sees_done(self, seq: int) -> bool:
            return self.done >= seq

    monkeypatch.setattr(ipc, "StreamOps", _Ops)
    path = ipc.IpcPath.__new__(ipc.IpcPath)
    path.device, path._aborted, path._poller = 0, False, None
    path.stream = type("Stream", (), {"cuda_stream": 7})()
    path._flags = {1: _PairFlags(1), 2: _PairFlags(2)}
    woken = threading.Event()
    path._wake = woken.set
    gated = ipc.GatedPulls(5, {1: [(10, 11, 8)], 2: [(20, 21, 8), (30, 31, 4)]}, [2])
    try:
        assert not path.advance(gated) and queued == []  # nothing seen yet: nothing queued
        path.watch(gated, lambda: False)
        assert gated.watched and not woken.wait(0.05)
        path._flags[2].ready = 5
        assert woken.wait(5) and not gated.watched
        assert not path.advance(gated)
        assert queued == [("copy", 20, 21, 8), ("copy", 30, 31, 4), ("write", 1002, 5)]
        assert gated.waiting_for == [1, 2]
        queued.clear()
        path._flags[1].ready = 6  # a later collective's flag: this one's is met too
        assert not path.advance(gated)  # rank 2 has not read this rank's inputs yet
        assert queued == [("copy", 10, 11, 8), ("write", 1001, 5)]
        woken.clear()
        path.watch(gated, lambda: False)
        path._flags[2].done = 5
        assert woken.wait(5)
        assert path.advance(gated) and gated.waiting_for == []
        # A collective that finished otherwise stops being watched; an aborted group's
        # released flags are never taken for the peer's.
        woken.clear()
        path.watch(ipc.GatedPulls(6, {1: []}, []), lambda: True)
        assert woken.wait(5)
        path._aborted = True
        with pytest.raises(FreescaleError, match="aborted"):
            path.advance(ipc.GatedPulls(7, {1: []}, []))
    finally:
        if path._poller is not None:
            path._poller.close()
            assert not path._poller._thread.is_alive()


class _QuietTransport:
    """What the engine asks of a transport, with nothing to move (pure engine logic)."""

    def wake(self) -> None:
        pass

    def progress(self) -> None:
        pass

    def wait_event(self, ms: int) -> None:
        time.sleep(ms / 1000)


class _Healthy:
    def health_error(self, waited_s: float) -> None:
        return None

    def departure_error(self, seq: int) -> None:
        return None


class _CountedOp:
    """An op that never moves by itself; records the threads that advance it."""

    def __init__(self) -> None:
        self.group, self.seq, self.started = _Healthy(), 1, time.monotonic()
        self.deadline = self.started + 60
        self.finished, self.needs_engine, self.queued_behind = False, True, False
        self.uses_transport, self.idle_poll_s, self.alone_yields = False, 0.0, ALONE_YIELDS
        self.advanced_by: list[int] = []

    def advance(self) -> bool:
        self.advanced_by.append(threading.get_ident())
        return False

    def expire(self) -> None:
        self.finished = True

    def fail(self, reason: str, kind: str) -> None:
        self.finished = True


@pytest.fixture
def engine() -> Any:
    engine = Engine(_QuietTransport(), None)
    yield engine
    with engine._cond:
        for op in [*engine._ops, engine._claimed]:  # left by a failed test: let the thread stop
            if op is not None:
                op.finished = True
        engine._stopping = True
        engine._cond.notify()
    engine._thread.join(5)
    assert not engine._thread.is_alive()


def test_a_wait_takes_back_an_op_the_engine_has_alone_and_hands_it_back(engine):
    op = _CountedOp()
    engine.submit(op)
    deadline = time.monotonic() + 5
    while not engine.take_back(op):  # refused while the engine thread steps it
        assert time.monotonic() < deadline
    taken_at = len(op.advanced_by)
    engine.drive(op, time.monotonic() + 0.05)
    mine = op.advanced_by[taken_at:]
    assert mine and set(mine) == {threading.get_ident()}  # the engine thread left it alone
    deadline = time.monotonic() + 5  # handed back unfinished: the engine steps it again
    while engine._thread.ident not in op.advanced_by[taken_at + len(mine) :]:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert not engine.take_back(_CountedOp())  # one it does not have
    op.finished = True


def test_a_handle_polled_beside_a_driving_wait_leaves_the_drive_alone(engine):
    op = _CountedOp()
    assert engine.claim(op)
    driving = threading.Thread(target=engine.drive, args=(op, time.monotonic() + 10))
    driving.start()
    deadline = time.monotonic() + 5
    while not op.advanced_by:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    engine.hand_over(op)  # ``is_completed`` from another thread
    engine.drive(op, time.monotonic() + 10)  # a second wait: returns at once
    time.sleep(0.05)
    assert set(op.advanced_by) == {driving.ident}  # only the first wait drives it, still
    op.finished = True  # ends the first wait's drive
    driving.join(5)
    assert not driving.is_alive()
