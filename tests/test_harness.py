"""The multi-process harness reports failures per rank and recovers from them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from freescale_comm._local_ranks import RANK_START_ENV
from tests.harness import GroupSpec, LocalGroup, RankFailure, run_ranks


def all_reduce_rank() -> int:
    value = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(value)
    return int(value)


def raise_on_rank(bad: int) -> int:
    if dist.get_rank() == bad:
        raise ValueError(f"planted failure on rank {bad}")
    return dist.get_rank()


def sleep_on_rank(bad: int, seconds: float) -> None:
    if dist.get_rank() == bad:
        time.sleep(seconds)


def exit_on_rank(bad: int) -> None:
    if dist.get_rank() == bad:
        os._exit(3)


def kill_on_rank(bad: int) -> None:
    if dist.get_rank() == bad:
        os.kill(os.getpid(), signal.SIGKILL)


def environment() -> dict[str, str]:
    return dict(os.environ)


def parent_pid() -> int:
    return os.getppid()


def fork_server_state() -> tuple[int, int, bool, bool]:
    """The process this rank was started from: its pid, its thread count; CUDA in this rank."""
    server = os.getppid()
    threads = len(os.listdir(f"/proc/{server}/task"))
    return server, threads, torch.cuda._is_in_bad_fork(), torch.cuda.is_initialized()


def _exited(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "\nState:\tZ" in status.read_text()  # a zombie nobody reaps has exited too
    except FileNotFoundError:
        return True


def test_runs_many_cases_on_one_group(local_groups):
    group = local_groups.get(2)
    assert group.run(all_reduce_rank) == [3, 3]
    assert group.run(all_reduce_rank) == [3, 3]


def test_failures_name_the_rank_and_the_group_recovers():
    with LocalGroup(2) as group:
        with pytest.raises(RankFailure, match=r"rank 1: error[\s\S]*planted failure on rank 1"):
            group.run(raise_on_rank, 1)
        # The rank cannot answer before its sleep ends, 1 s after the 2 s bound; a short sleep
        # lets the group close politely instead of waiting out close()'s 5 s grace for it.
        with pytest.raises(RankFailure, match=r"rank 0: timeout"):
            group.run(sleep_on_rank, 0, 3.0, timeout_s=2.0)
        with pytest.raises(RankFailure, match=r"rank 1: died[\s\S]*code 3") as failure:
            group.run(exit_on_rank, 1)
        assert failure.value.results == {0: None}
        assert list(failure.value.failures) == [1]
        with pytest.raises(RankFailure, match=r"rank 1: died[\s\S]*code -9"):
            group.run(kill_on_rank, 1)
        assert group.run(all_reduce_rank) == [3, 3]


def raise_or_block(bad: int) -> None:
    if dist.get_rank() == bad:
        raise ValueError("planted failure")
    dist.all_reduce(torch.ones(1))  # the peer never joins: blocked until the group's timeout


def test_stop_on_error_does_not_wait_for_a_blocked_peer():
    started = time.monotonic()
    with pytest.raises(RankFailure, match="planted failure") as failure:
        run_ranks(GroupSpec(2, init_timeout_s=60), raise_or_block, 1, timeout_s=45)
    assert time.monotonic() - started < 30
    assert failure.value.failures[1][0] == "error"
    assert failure.value.failures[0][0] == "stopped"


def test_one_shot_run_and_bad_world_size():
    assert run_ranks(GroupSpec(2), all_reduce_rank, timeout_s=60) == [3, 3]
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        GroupSpec(0)


def report_twice_the_rank(rank: int, port: int, queue, fail_on: int) -> None:
    """A target that joins a group itself on the launcher's store and reports on a queue."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    if rank == fail_on:
        queue.put((rank, "error", "planted report"))
    else:
        queue.put((rank, "ok", 2 * rank))
    dist.destroy_process_group()


def test_reporting_targets_keep_the_bench_launchers_working():
    from freescale_embed.bench import launch_ranks

    assert launch_ranks(report_twice_the_rank, 2, (-1,), 60) == {0: ("ok", 0), 1: ("ok", 2)}
    replies = launch_ranks(report_twice_the_rank, 2, (1,), 60, stop_on_error=True)
    assert replies[1][0] == "error" and "planted report" in replies[1][1]


def test_ranks_fork_from_a_server_without_threads_or_cuda(monkeypatch):
    monkeypatch.setenv(RANK_START_ENV, "forkserver")
    # The server imported torch but started no thread and left CUDA alone, so forked ranks can
    # use both; it is not the test process (which spawned ranks would have as parent).
    [(server, threads, bad_fork, cuda)] = run_ranks(GroupSpec(1), fork_server_state, timeout_s=60)
    assert server != os.getpid()
    assert (threads, bad_fork, cuda) == (1, False, False)


def test_forked_ranks_have_the_launching_environment_of_their_start(monkeypatch):
    monkeypatch.setenv(RANK_START_ENV, "forkserver")
    run_ranks(GroupSpec(1, backend=None), parent_pid, timeout_s=60)  # the fork server runs now
    monkeypatch.setenv("FREESCALE_TEST_SET_LATER", "parent")
    monkeypatch.delenv("FREESCALE_TEST_UNSET", raising=False)
    spec = GroupSpec(2, backend=None, env={"FREESCALE_TEST_FROM_SPEC": "spec"})
    expected = {**os.environ, **spec.env, "OMP_NUM_THREADS": "1"}
    assert run_ranks(spec, environment, timeout_s=60) == [expected, expected]


def test_spawned_ranks_on_request_and_a_bad_start_method(monkeypatch):
    monkeypatch.setenv(RANK_START_ENV, "spawn")
    assert run_ranks(GroupSpec(1, backend=None), parent_pid, timeout_s=120) == [os.getpid()]
    monkeypatch.setenv(RANK_START_ENV, "fork")
    with pytest.raises(ValueError, match="FREESCALE_RANK_START must be one of"):
        run_ranks(GroupSpec(1, backend=None), parent_pid, timeout_s=60)


def test_auto_start_spawns_where_a_gpu_is(monkeypatch, tmp_path):
    from freescale_comm import _local_ranks

    monkeypatch.delenv(RANK_START_ENV, raising=False)
    device_file = tmp_path / "nvidiactl"
    monkeypatch.setattr(_local_ranks, "_GPU_DEVICE_FILE", str(device_file))
    assert _local_ranks._start_method() == "forkserver"
    device_file.touch()
    assert _local_ranks._start_method() == "spawn"
    monkeypatch.setenv(RANK_START_ENV, "forkserver")
    assert _local_ranks._start_method() == "forkserver"


def test_the_fork_server_exits_with_the_launching_process():
    code = (
        "import os; from freescale_comm._local_ranks import GroupSpec, run_ranks; "
        "print(run_ranks(GroupSpec(1, backend=None), os.getppid, timeout_s=60)[0])"
    )
    env = {**os.environ, RANK_START_ENV: "forkserver"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    server = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while not _exited(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    exited = _exited(server)
    if not exited:
        os.kill(server, signal.SIGKILL)
    assert exited
