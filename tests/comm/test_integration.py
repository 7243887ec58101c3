"""The backend inside torch.distributed: delegation, subgroups, async, functional, DDP."""

from __future__ import annotations

import pytest
import torch

from tests.comm import ranks
from tests.comm.conftest import SETUP


def test_delegated_ops_run_on_gloo(fs_group):
    n = fs_group.spec.world_size
    for rank, result in enumerate(fs_group.run(ranks.delegated_ops)):
        reduced = n if rank == 0 else 0.0
        assert result == [n * (n + 1) / 2, n - 1, rank * n, reduced, (rank - 1) % n]


def test_delegated_ops_back_to_back_do_not_deadlock(local_groups):
    # One process per rank is enough: the deadlock was between threads of one process. A
    # thousand rounds take about a second; before the fix nearly every run hung within them.
    group = local_groups.get(2, backend="freescale", setup=SETUP, init_timeout_s=60)
    assert group.run(ranks.delegated_ops_back_to_back, 1000, timeout_s=120) == [1000, 1000]


def test_per_device_backend_strings(fs_group):
    # c10d hands a group wholly to a backend that is a ProcessGroup, whatever else the string
    # names: a device given to Gloo / NCCL runs there, and another backend is refused.
    for report in fs_group.run(ranks.per_device_backend_strings, timeout_s=90):
        assert report["cpu:gloo,cuda:freescale"] == 0, report
        assert report["cpu:freescale,cuda:nccl"] == 2, report
        assert "not on 'ucc'" in report["cpu:freescale,cuda:ucc"], report


@pytest.mark.parametrize("elements", [5, 300_000])  # direct; ring on 4 ranks (>= 1 MiB)
def test_in_place_all_gather(fs_group, fs_group4, elements):
    for group in (fs_group, fs_group4):
        assert group.run(ranks.in_place_all_gather, elements) == [True] * group.spec.world_size


@pytest.mark.parametrize("elements", [2, 40_000, 300_000])  # folded, rings, UCX
def test_overlapping_inputs_and_outputs(fs_group, elements):
    # In place on every rank: a peer's piece lands where this rank's piece for it lay.
    want = ["all_to_all_single", "all_to_all", "all_gather_into_tensor"]
    assert fs_group.run(ranks.overlapping_inputs, elements) == [want] * fs_group.spec.world_size


def test_all_gather_coalesced_matches_gloo(fs_group):
    assert fs_group.run(ranks.all_gather_coalesced_like_gloo) == [6] * fs_group.spec.world_size


def test_a_coalesced_all_gather_may_mix_dtypes_by_input(fs_group):
    # NCCL accepts one; the ranks must agree on each input's dtype, and each input's outputs
    # must have its dtype, or every rank raises.
    n = fs_group.spec.world_size
    per_rank = fs_group.run(ranks.all_gather_mixing_dtypes)
    assert len(per_rank) == n
    for other_dtype, output_dtype in per_rank:
        assert "int64+int16+bool" in other_dtype and "int64+float16+bool" in other_dtype
        assert "input 0 has dtype torch.int64 but an output for it torch.float64" in output_dtype


def test_all_gather_coalesced_of_one_rank_matches_gloo(local_groups):
    # Gloo's future then holds one list by input, not one list per rank.
    group = local_groups.get(1, backend="freescale", setup=SETUP, init_timeout_s=60)
    assert group.run(ranks.all_gather_coalesced_like_gloo) == [6]


def test_the_ring_all_gather_is_chosen_alike_on_every_rank(fs_group4):
    errors = fs_group4.run(ranks.ring_gathers_only_even_pieces, timeout_s=90)
    # Every rank names every rank that differs from rank 0, and how.
    differing = [f"rank {r} has allgather='direct' where rank 0 has 'ring'" for r in (1, 2, 3)]
    assert all(len(e) == 1 and all(d in e[0] for d in differing) for e in errors), errors
    assert "(this rank has" not in errors[0][0]
    assert all("(this rank has" in e[0] for e in errors[1:]), errors


def test_subgroups(fs_group4):
    results = fs_group4.run(ranks.subgroups)
    assert results[0] == [1.0, 1.0]
    assert results[1] == [1.0, 6.0, 1.0]
    assert results[2] == [6.0, 5.0]
    assert results[3] == [6.0, 5.0]


def test_device_mesh_dimensions_are_freescale_groups(fs_group4):
    for rank, result in enumerate(fs_group4.run(ranks.device_mesh)):
        tp = [2 * (rank // 2), 2 * (rank // 2) + 1]
        dp = [rank % 2, rank % 2 + 2]
        assert result[:2] == ["freescale", "freescale"]
        assert result[2] == [v for r in tp for v in (float(r), 10.0 * r)]
        position = dp.index(rank)
        assert result[3] == [2 * position + k + 100.0 * r for r in dp for k in range(2)]
        assert result[4] == [v for r in dp for v in (float(r), 10.0 * r)]


def test_async_and_futures(fs_group):
    assert fs_group.run(ranks.async_ops, 3) == [True] * fs_group.spec.world_size


def test_a_work_is_completed_once_its_future_is(fs_group):
    # A thread woken by the future asked before the event was set, and heard "not completed".
    for seen in fs_group.run(ranks.completed_once_the_future_is, 5):
        assert seen and all(seen), seen


@pytest.mark.parametrize("elements", [300_000])  # sent to the rings with the headers
def test_collectives_of_two_threads_start_in_the_order_they_are_numbered(fs_group, elements):
    # A thread preempted between taking its collective's number and starting it let a later
    # one's early data into the rings ahead of its own: every rank timed out.
    n = fs_group.spec.world_size
    want = {"first": [float(r) for r in range(n)], "second": [float(r) for r in range(n)]}
    assert fs_group.run(ranks.a_thread_preempted_before_its_start, elements) == [want] * n


def test_a_collective_started_beside_an_express_poll_starts_at_once(fs_group):
    # The express path polls for late peers holding the group's launch lock; a second thread's
    # collective waited for that poll to end (here 30 s, or the peers' arrival 1.5 s later).
    n = fs_group.spec.world_size
    results = fs_group.run(ranks.a_launch_beside_an_express_poll, 1.5, timeout_s=90)
    assert results[0]["started_after_s"] < 0.75, results[0]
    for result in results:
        assert result["first"] == [float(r) for r in range(n)], result
        assert result["second"] == [float(r + 10) for r in range(n)], result


@pytest.mark.skipif(not hasattr(torch.distributed, "all_gather_single"), reason="torch 2.13's API")
def test_all_gather_single_takes_the_own_all_gather(fs_group):
    n = fs_group.spec.world_size
    assert fs_group.run(ranks.all_gather_single_is_own) == [(True, ["all_gather_into_tensor"])] * n


def test_functional_collectives_and_compile(local_groups):
    group = local_groups.get(
        2, backend="freescale", setup="freescale_comm:register", init_timeout_s=60
    )
    n = 2
    gathered = n * 6 + 40 * n * (n - 1) / 2
    for rank, result in enumerate(group.run(ranks.functional_and_compile, True, timeout_s=180)):
        assert result == [gathered, n * (4 * rank + 1) + 100 * n * (n - 1), 2 * gathered]


@pytest.mark.parametrize("steps", [3])
def test_ddp_matches_gloo(fs_group, steps):
    ours = fs_group.run(ranks.ddp_train, "freescale", steps)
    gloo = fs_group.run(ranks.ddp_train, "gloo", steps)
    assert ours == gloo
    assert all(r == ours[0] for r in ours)


def test_ctrl_c_while_ddp_waits_raises_keyboard_interrupt(fs_group):
    # DDP's reducer took the value of the Python future chained to Gloo's with Python code on
    # the waiting thread, where the interrupt landed: it raised "RuntimeError: Cannot extract
    # tensors from value: KeyboardInterrupt", and a handler that saves a checkpoint missed it.
    results = fs_group.run(ranks.ctrl_c_while_ddp_waits, timeout_s=60)
    assert results[0] == "KeyboardInterrupt" and set(results[1:]) == {"none"}, results


def test_ddp_with_a_comm_hook_whose_callback_waits_for_a_collective_matches_gloo(fs_group):
    # (torch's PowerSGD hook, which does the same, all-reduces: Gloo's collectives, not ours.)
    ours = fs_group.run(ranks.ddp_train, "freescale", 5, "gather_mean", timeout_s=60)
    gloo = fs_group.run(ranks.ddp_train, "gloo", 5, "gather_mean", timeout_s=60)
    assert ours == gloo
    assert all(r == ours[0] for r in ours)


def test_future_callbacks_may_start_collectives_and_wait_for_them(fs_group):
    assert fs_group.run(ranks.nested_future_collectives, 3) == [6] * fs_group.spec.world_size


@pytest.mark.parametrize("idle_wait", ["yield", "sleep", "auto"])
def test_a_rank_waiting_for_a_late_peer_polls_briefly_then_sleeps(fs_group, idle_wait):
    # A rank that waits a second for a late peer spends a few milliseconds of CPU on it, not
    # the second, whether it first polls, yielding its core, or sleeps at once.
    from freescale_comm.engine import POLL_S, YIELD_S

    results = fs_group.run(ranks.late_peer_wait_cost, idle_wait, timeout_s=60)
    for r in results:
        auto_s = YIELD_S if r["oversubscribed"] else POLL_S
        expected = {"yield": YIELD_S, "sleep": 0.0, "auto": auto_s}[idle_wait]
        assert r["poll_s"] == expected, r
    assert results[0]["waited_s"] > 0.9
    assert results[0]["cpu_s"] < 0.3, results[0]
