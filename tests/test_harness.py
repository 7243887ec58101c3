"""The multi-process harness reports failures per rank and recovers from them."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

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
