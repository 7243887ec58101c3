"""Bad inputs, a killed peer and shutdown: errors everywhere, hangs nowhere, no threads left."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

from tests.comm import ranks
from tests.comm.conftest import FAST_FAILURE_ENV, SETUP
from tests.harness import (
    GroupSpec,
    LocalGroup,
    RankFailure,
    free_port,
    reads_allowed,
    run_ranks,
    run_sessions,
)
from tests.xdist_groups import GLOO_GROUPS


def test_bad_inputs_fail_on_every_rank_before_data_moves(fs_group):
    per_rank = fs_group.run(ranks.bad_inputs)
    # Every rank reports the same problems (they judged the same table of signatures).
    for messages in per_rank:
        assert len(messages) == 8
        assert [m.split(": ", 1)[1] for m in messages] == [m.split(": ", 1)[1] for m in per_rank[0]]
    first = per_rank[0]
    assert "which expects 12 (sizes or split sizes disagree" in first[0]
    assert "ranks disagree: rank 0 has dtype torch.float64" in first[1]
    assert "rank 0: all_gather_into_tensor output has" in first[2]
    assert "split sizes disagree" in first[3]
    assert "split sizes add up to" in first[4]
    assert "expects" in first[5]
    assert "split into tensors of other sizes than it expects" in first[6]
    assert "ranks disagree: rank 0 calls all_gather_into_tensor, rank" in first[7]
    assert first[7].endswith("all_to_all_single")


def test_new_user_mistakes_fail_on_every_rank_at_once(fs_group):
    per_rank = fs_group.run(ranks.new_user_mistakes, timeout_s=30)
    for messages in per_rank:
        assert len(messages) == 12
        # At once: well inside the group timeout (60 s), not after it.
        assert all(float(m.split(" ", 1)[0]) < 5 for m in messages), messages
        for m in messages[:2]:
            assert "rank 0: " in m and "got a tensor on meta" in m, m
        assert "rank 0: all_gather mixes devices meta and cpu" in messages[2]
        assert "contain a negative size" in messages[3] and "add up" not in messages[3]
        assert "rank 0: all_to_all_single input split sizes [1.0" in messages[4], messages[4]
        assert "are not all integers" in messages[4]
        assert (
            "rank 0: all_to_all_single got a negative or conjugate view as an output" in messages[5]
        )
        assert "needs one output list per rank" in messages[6], messages[6]
        assert "rank 0: all_to_all_single got an output whose elements share memory" in messages[7]
        assert "rank 0: all_to_all_single got a torch.sparse_csr tensor; only dense" in messages[8]
        assert (
            "rank 0: all_to_all_single got a _StorageLess whose elements are not in"
            in (messages[9])
        )
        assert "rank 0: all_to_all_single got a Tensor whose elements are not in" in messages[10]
        assert "rank 0: all_gather_into_tensor" in messages[11], messages[11]


def test_calls_gloo_refuses_raise_its_error_at_once_and_leave_the_group_usable(fs_group):
    # Before, each raised after two liveness polls (1 s) and aborted the group on every rank
    # ("allreduce on Gloo failed: ..."); a send to a rank past the group's crashed the process.
    for errors in fs_group.run(ranks.calls_gloo_refuses, timeout_s=60):
        assert len(errors) == 9, errors
        assert all(seconds < 0.5 for seconds, _, _ in errors), errors
        refused = [(kind, message) for _, kind, message in errors]
        assert refused[0] == ("RuntimeError", "Cannot use ReduceOp.BAND with non-integral dtype")
        assert refused[1] == refused[3] == ("RuntimeError", "Invalid scalar type")
        assert refused[2][0] == "RuntimeError" and "can't be cast" in refused[2][1]
        assert refused[4] == ("RuntimeError", "Cannot use ReduceOp.BOR with non-integral dtype")
        assert refused[5][0] == "RuntimeError" and "contiguous" in refused[5][1], refused[5]
        n = fs_group.spec.world_size
        assert refused[6][0] == refused[7][0] == "ValueError", refused[6:]
        assert refused[6][1].endswith(f"send to rank {n + 3}: the group's ranks are 0 to {n - 1}")
        assert refused[7][1].endswith(f"recv from rank {n}: the group's ranks are 0 to {n - 1}")
        assert refused[8][0] == "ValueError" and "rank -1" in refused[8][1], refused[8]


def test_a_rank_without_ucx_fails_every_ranks_set_up_at_once():
    # Its peers waited for the group timeout (30 s here), then raised a store timeout naming
    # directory keys; the rank itself raised at once.
    spec = GroupSpec(2, "gloo", setup=SETUP, init_timeout_s=30)
    messages = run_ranks(spec, ranks.a_rank_without_ucx, 1, timeout_s=60)
    for message in messages:
        assert float(message.split(" ", 1)[0]) < 5, messages
    assert "ImportError" in messages[1] and "pip install" in messages[1], messages
    assert "FreescaleValidationError" in messages[0], messages
    assert "rank 1 has" in messages[0] and "rank 1 cannot load UCX" in messages[0], messages


def test_a_timeout_in_the_calls_options_bounds_it(fs_group):
    # It waited for the group's timeout (30 s here); Gloo honours the call's own.
    seconds, error = fs_group.run(ranks.a_call_with_its_own_timeout, timeout_s=60)[0].split(" ", 1)
    assert "FreescaleTimeoutError" in error and "did not finish within 2 s" in error, error
    assert float(seconds) < 5, (seconds, error)


@pytest.mark.parametrize("count", [4, 300_000], ids=["16B", "1.2MB"])
def test_a_short_message_without_validation_fails_its_receiver(fs_group, count):
    # Rank 1 expects more from rank 0 than rank 0 sends: it returned success with the rest of
    # that piece unwritten. Now its receive on the host's rings fails, and the group with it.
    results = fs_group.run(ranks.a_size_mismatch_without_validation, count, timeout_s=60)
    error = results[1]["error"]
    assert "FreescalePeerError" in error and "the ranks' calls disagree" in error, error
    assert float(error.split(" ", 1)[0]) < 5, error
    for rank, result in enumerate(results):
        # Every other rank got what it expected: its output is right, whether or not the
        # group's abort reached it before it returned.
        assert rank == 1 or result["output_right"], (rank, result)


@pytest.mark.parametrize(
    ("rank_fn", "own_error", "peers_see"),
    [
        # Its own bad splits in a group that does not validate: it raises before any message.
        (ranks.a_mistake_without_validation, "FreescaleValidationError", "could not start"),
        # An internal error while its data moves.
        (ranks.an_internal_error_on_one_rank, "FreescaleError", "injected"),
        # An interrupt after it took the collective's outbox number, before it wrote there.
        (
            ranks.an_interrupt_while_a_collective_starts,
            "KeyboardInterrupt",
            "could not start: KeyboardInterrupt",
        ),
    ],
    ids=["mistake-without-validation", "internal-error", "interrupt-while-starting"],
)
def test_a_failure_on_one_rank_fails_every_rank_at_once(fs_group, rank_fn, own_error, peers_see):
    per_rank = fs_group.run(rank_fn, timeout_s=60)
    for rank, message in enumerate(per_rank):
        seconds, error = message.split(" ", 1)
        assert float(seconds) < 5, message  # the group's timeout is 60 s
        if rank == 0:
            assert error.startswith(f"{own_error}:"), error
        else:
            assert error.startswith("FreescalePeerError") and peers_see in error, error


def test_an_interrupt_while_a_collective_waits_raises_at_once_and_the_collective_goes_on(fs_group):
    reports = fs_group.run(ranks.an_interrupt_while_a_collective_waits, timeout_s=60)
    first, n = reports[0], len(reports)
    assert first["raised"] == "KeyboardInterrupt" and first["raised_after_s"] < 1.5, first
    assert first["output_at_interrupt"][1] == 0, first  # rank 1 had not called yet
    for rank, report in enumerate(reports):
        assert report["output_later"] == [1.0 + peer for peer in range(n)], (rank, report)
        assert report["next_call"] == [10.0 + peer for peer in range(n)], (rank, report)


@pytest.mark.parametrize("step", ["directory", "rings", "outbox"])
def test_a_peer_dying_during_set_up_fails_it_within_the_timeout_and_leaves_nothing(step):
    group = LocalGroup(2, backend="freescale", setup=SETUP, init_timeout_s=20)
    try:
        group.start()
        with pytest.raises(RankFailure) as failure:
            group.run(ranks.die_while_a_group_is_set_up, 1, step, timeout_s=40)
    finally:
        group.close()
    report = str(failure.value)
    assert "rank 1: died" in report, report
    found = re.search(r"survivor 0 raised after ([0-9.]+) s, leaving \[\]", report)
    assert found and float(found.group(1)) < 15, report  # the group timeout is 5 s


@pytest.mark.skipif(not reads_allowed(), reason="the kernel refuses reads of a peer's memory")
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_peer_dying_in_the_host_probe_fails_every_rank_at_once(world_size):
    # The ranks of the host measure the rings against the reads at set-up; rank 1 exits there.
    # Its neighbours see its process gone, the others see them give up: every survivor raises
    # well within the group timeout (5 s), having left nothing in /dev/shm.
    group = LocalGroup(world_size, backend="freescale", setup=SETUP, init_timeout_s=20)
    try:
        group.start()
        with pytest.raises(RankFailure) as failure:
            group.run(ranks.die_while_a_group_is_set_up, 1, "probe", timeout_s=40)
    finally:
        group.close()
    report = str(failure.value)
    assert "rank 1: died" in report, report
    for survivor in [r for r in range(world_size) if r != 1]:
        found = re.search(rf"survivor {survivor} raised after ([0-9.]+) s, leaving \[\]", report)
        assert found and float(found.group(1)) < 3, report
        assert "FreescalePeerError: the host path probe of the group's set-up stopped" in report
    # Found by the probe, or first by the group's liveness (which watches the same processes).
    assert re.search(r"rank 1[^\n]* on this host[^\n]* has exited", report), report


@pytest.mark.parametrize(
    ("per_peer", "shm_max_bytes", "copy_threads"),
    [
        (256, "-1", "0"),
        (1 << 20, "0x100000000", "0"),
        (1 << 20, "0x100000000", "3"),  # own pieces of 4 MiB on helper threads
        (1 << 18, "0x80000", "0"),
        (1 << 20, "0x80000", "0"),
        (1 << 21, "0x80000", "3"),  # reads of 8 MiB split over helper threads
    ],
    ids=["rings", "large-rings", "large-rings-helpers", "reads", "large-reads", "split-reads"],
)
@pytest.mark.parametrize("world_size", [2, 4])
def test_killed_peer_makes_every_survivor_raise(world_size, per_peer, shm_max_bytes, copy_threads):
    env = {
        **FAST_FAILURE_ENV,
        "FREESCALE_SHM_MAX_BYTES": shm_max_bytes,
        "FREESCALE_HOST_COPY_THREADS": copy_threads,
    }
    group = LocalGroup(world_size, backend="freescale", setup=SETUP, init_timeout_s=20, env=env)
    try:
        group.start()
        pids = group.pids
        start = time.monotonic()
        with pytest.raises(RankFailure) as failure:
            group.run(ranks.die_during_collective, world_size - 1, 0.5, per_peer, timeout_s=40)
        elapsed = time.monotonic() - start
    finally:
        group.close()
    report = str(failure.value)
    assert f"rank {world_size - 1}: died" in report
    for survivor in range(world_size - 1):
        assert f"survivor {survivor} raised after" in report
    assert "timeout" not in report.split("---")[0]
    # Detected by heartbeat (3 s) or abort, well inside the 20 s group timeout.
    assert elapsed < 15, report
    # Its messages took the shared-memory rings (1 KiB and 4 MiB per peer), or were read from
    # its memory by the survivors (1 and 4 MiB; UCX's cross-memory attach, which the reads
    # replace, aborted a reader of a process killed meanwhile); the segments were unlinked once
    # mapped, so the dead process left nothing in /dev/shm (counted for this group's processes:
    # tests running beside it make theirs).
    mine = tuple(f"freescale-ring-{pid}-" for pid in pids)
    assert [f for f in os.listdir("/dev/shm") if f.startswith(mine)] == []
    assert f"rank {world_size - 1}" in report.split("survivor")[1]


@pytest.mark.parametrize(("world_size", "per_peer"), [(2, 16 << 20), (4, 4 << 20)])
def test_a_peer_killed_mid_transfer_between_pretend_hosts_makes_survivors_raise(
    world_size, per_peer
):
    # Before: UCX read the large messages by cross-memory attach, and a read from the killed
    # process aborted every survivor (SIGABRT in cma_ep.c).
    group = LocalGroup(world_size, setup=SETUP, init_timeout_s=20, env=FAST_FAILURE_ENV)
    try:
        group.start()
        with pytest.raises(RankFailure) as failure:
            group.run(
                ranks.die_during_collective_on_pretend_hosts,
                world_size - 1,
                1.5,
                per_peer,
                timeout_s=40,
            )
    finally:
        group.close()
    report = str(failure.value)
    assert f"rank {world_size - 1}: died" in report
    for survivor in range(world_size - 1):
        assert f"survivor {survivor} raised after" in report, report


@GLOO_GROUPS
def test_destroy_frees_the_groups_context_at_once(local_groups):
    # Reference cycles kept it (and what it refers to) until the next garbage collection.
    assert local_groups.get(2).run(ranks.context_freed_by_destroy) == [True, True]


def test_destroy_leaves_no_threads(local_groups):
    group = local_groups.get(2)  # a Gloo world; the freescale group is made inside it
    for result in group.run(ranks.threads_after_destroy):
        # The engine, the group's liveness thread (and its callback thread, where the callback
        # was attached before the AllGather was done) ...
        assert {"freescale-comm-engine", "freescale-comm-liveness"} <= set(result["engine_during"])
        ours = {"freescale-comm-engine", "freescale-comm-liveness", "freescale-comm-callbacks"}
        assert set(result["engine_during"]) <= ours
        # ... UCX's progress and async threads and the subgroup's Gloo threads ...
        assert len(result["during"]) >= len(result["before"]) + 3
        assert "async" in result["during"]
        # ... and none of them once the group is destroyed.
        assert result["after"] == result["before"]
        assert result["left"] == []


def test_a_collective_that_cannot_start_aborts_beside_a_chained_callback():
    # The abort ran under the group's launch lock and waited for a collective that the engine
    # thread was completing, whose callback chained by collect_all waited for the launch lock:
    # every group of the process stopped.
    group = LocalGroup(2, backend="freescale", setup=SETUP, init_timeout_s=30)
    try:
        group.start()
        seen, _ = group.run(ranks.a_failed_start_beside_a_chained_callback, timeout_s=60)
    finally:
        group.close()
    assert seen["failing_thread_done"], seen
    assert len(seen["failed"]) == 1 and "could not start" not in seen["failed"][0], seen
    assert "simulated" in seen["failed"][0] and len(seen["chained"]) <= 1, seen


def test_a_collect_all_callback_that_waits_for_a_collective_raises_on_every_rank(fs_group):
    # On the engine thread, which alone would progress the collective, the wait hung the rank
    # until the group timeout; a rank whose callback ran in its own thread instead (its future
    # was done when the callback was attached) waited that long for peers that had refused.
    per_rank = fs_group.run(ranks.a_collect_all_callback_that_waits)
    for message, elapsed, later in per_rank:
        assert "torch.futures.collect_all" in message, per_rank
        assert elapsed < 10, per_rank  # the group timeout is 20 s
        assert "aborted" in later, per_rank
    assert "the group is aborted on every rank" in per_rank[1][0], per_rank


def test_a_collect_all_callback_may_wait_for_the_collective_it_follows(fs_group):
    # That collective is finished there, but its event is set only once the callbacks return.
    assert (
        fs_group.run(ranks.a_collect_all_callback_that_waits_for_its_own_collective)
        == [(True, True)] * fs_group.spec.world_size
    )


def test_a_timeout_says_which_peers_never_sent_a_header(local_groups):
    # Told apart from data that stopped coming: those peers did not call this collective.
    group = local_groups.get(2, backend="freescale", setup=SETUP, init_timeout_s=60)
    message, other = group.run(ranks.a_peer_that_never_calls, timeout_s=60)
    assert "did not finish within 2 s; no header yet from rank 1" in message, message
    assert "no data" not in message and other == ""


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("validate", False),
        ("eager_bytes", 16),
        ("host_path", "ucx"),
        ("shm_slot_bytes", 128 << 10),
        ("dead_after_s", 30.0),  # its watcher would blame a rank beating less often
        ("wire_version", 1000),  # a rank of another version
    ],
)
def test_options_that_must_match_fail_set_up_on_every_rank(local_groups, field, value):
    # Before: a rank without validation, or with another eager size, host path or ring slot,
    # made the group's first collectives time out, fail as an "internal error", set-up hang,
    # or (slots) return wrong data.
    reports = local_groups.get(2).run(ranks.mismatched_shared_options, field, value, timeout_s=60)
    for rank, (message, took) in enumerate(reports):
        # Every rank names the rank that differs, the field and both values.
        assert f"differ between ranks: rank 1 has {field}={value!r} where rank 0 has" in message
        assert took < 20, (rank, took)
    assert "(this rank has" in reports[1][0] and "(this rank has" not in reports[0][0]


@pytest.mark.parametrize(
    ("how", "why"),
    [
        ("env", "ValueError: shm_slot_bytes must be >= 4096 and shm_pool_bytes >= 2 slots"),
        ("type", "TypeError: pg_options of the freescale backend must be a FreescaleOptions"),
    ],
)
def test_options_refused_on_one_rank_fail_set_up_on_every_rank_at_once(local_groups, how, why):
    # Before: that rank raised alone, and the others waited for it until the group timeout.
    reports = local_groups.get(2).run(ranks.options_refused_on_one_rank, how, timeout_s=60)
    assert f"invalid FreescaleOptions on this rank: {why}" in reports[1][0], reports[1][0]
    if how == "env":
        assert "(given: shm_pool_bytes=65536)" in reports[1][0]
    assert "differ between ranks: rank 1 has invalid_options=" in reports[0][0], reports[0][0]
    assert why in reports[0][0] and reports[0][0].endswith("where rank 0 has none")
    assert all(took < 20 for _, took in reports), reports


@pytest.mark.parametrize("host_path", ["auto", "ucx"])
def test_an_exited_peer_on_the_host_is_reported_at_once(host_path):
    # Default liveness (dead after 10 s of silence): a peer of this host is also watched by
    # its process, so its exit is reported at the next poll, as Gloo's closed connection is,
    # whatever path its bytes take.
    group = LocalGroup(
        2,
        backend="freescale",
        setup=SETUP,
        init_timeout_s=20,
        env={"FREESCALE_HOST_PATH": host_path},
    )
    try:
        group.start()
        start = time.monotonic()
        with pytest.raises(RankFailure) as failure:
            group.run(ranks.die_during_collective, 1, 0.5, timeout_s=40)
        elapsed = time.monotonic() - start
    finally:
        group.close()
    report = str(failure.value)
    assert "rank 1: its process on this host" in report and "has exited" in report, report
    assert elapsed < 6, report


def test_a_destroy_does_not_wait_for_a_collective_its_callbacks_start(fs_group):
    # The collective a callback starts while the destroy fails the one it is chained to was
    # accepted, and no thread progressed it: the destroy took the group timeout (30 s).
    seen = fs_group.run(ranks.destroy_while_a_callback_starts_a_collective, timeout_s=90)[0]
    assert seen["destroy_s"] < 5, seen
    assert "the process group was shut down" in seen.get("callback", ""), seen


def test_a_chained_callback_may_wait_for_works_that_are_done(fs_group):
    # On the engine thread such a wait was refused, and the refusal aborted the group.
    for seen in fs_group.run(ranks.wait_for_a_finished_work_in_a_chained_callback, 5):
        assert seen == ["ok / ok"] * 5, seen


def test_a_destroy_waits_for_the_callbacks_still_running(fs_group):
    # It gave them 1 s and left their thread running.
    for seen in fs_group.run(ranks.destroy_while_a_callback_runs, timeout_s=60):
        assert seen["callback_finished"] and not seen["callback_thread_left"], seen
        assert seen["destroy_s"] < 10, seen


def test_a_timeout_set_on_the_group_later_bounds_its_own_collectives(local_groups):
    # _set_pg_timeout reached only the inner Gloo: raised, an own collective still failed at
    # the old 3 s; lowered, it waited the old timeout. split_group crashed the process.
    group = local_groups.get(2, backend="freescale", setup=SETUP, init_timeout_s=60)
    rank0 = group.run(ranks.timeout_set_after_creation, timeout_s=90)[0]
    assert "split_group is not supported" in rank0["split"], rank0
    assert rank0["raised"] == "ok", rank0
    assert rank0["lowered"].startswith("FreescaleTimeoutError after"), rank0
    assert float(rank0["lowered"].split()[2]) < 4, rank0


_EXIT_AFTER_A_PEER_DIED = """
import os, signal, sys, time
import torch, torch.distributed as dist
import freescale_comm  # noqa: F401  (where it is on the path, not installed: no entry point)
dist.init_process_group("freescale")
rank, size = dist.get_rank(), dist.get_world_size()
out, sent = torch.empty(1024 * size), torch.arange(1024.0 * size)
for _ in range(20):
    dist.all_to_all_single(out, sent)
dist.barrier()
if rank == 1:
    time.sleep(0.3)  # its peers are in their AllToAlls by then
    os.kill(os.getpid(), signal.SIGKILL)
try:
    while True:
        dist.all_to_all_single(out, sent)
except Exception as error:
    print(f"rank {rank} raised {type(error).__name__}", flush=True)
    sys.exit(3)  # the process exits with the error, its group never destroyed
"""


def test_a_survivor_that_exits_right_after_a_peer_died_exits_with_its_own_status(tmp_path):
    # The abort's error was raised while a thread still broke Gloo's connections inside
    # Gloo's wait; the interpreter ended that thread as it took the GIL back, through
    # pybind11's noexcept GIL guard: std::terminate, SIGABRT in 20 of 21 runs of 3 ranks.
    script = tmp_path / "rank.py"
    script.write_text(_EXIT_AFTER_A_PEER_DIED)
    size = 3
    env = {**os.environ, **FAST_FAILURE_ENV, "WORLD_SIZE": str(size)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    finished = run_sessions(
        [([sys.executable, str(script)], {**env, "RANK": str(rank)}) for rank in range(size)],
        timeout_s=60,
    )
    codes, outputs = [status for status, _ in finished], [output for _, output in finished]
    assert codes == [3, -signal.SIGKILL, 3], (codes, outputs)
    for rank in (0, 2):
        assert f"rank {rank} raised FreescalePeerError" in outputs[rank], outputs[rank]
        assert "terminate called" not in outputs[rank], outputs[rank]
