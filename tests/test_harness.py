"""The multi-process harness reports failures per rank and recovers from them."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import LocalGroup, RankFailure


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
        with pytest.raises(RankFailure, match=r"rank 0: timeout"):
            group.run(sleep_on_rank, 0, 30.0, timeout_s=2.0)
        with pytest.raises(RankFailure, match=r"rank 1: died[\s\S]*code 3") as failure:
            group.run(exit_on_rank, 1)
        assert failure.value.results == {0: None}
        assert list(failure.value.failures) == [1]
        assert group.run(all_reduce_rank) == [3, 3]
