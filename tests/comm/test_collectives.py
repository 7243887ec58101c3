"""Every own collective against the locally computed result and Gloo's, on random cases."""

from __future__ import annotations

import pytest

from tests.comm import ranks


def test_random_cases_match_reference_and_gloo(fs_group):
    counts = fs_group.run(ranks.run_random_cases, 1, 40, timeout_s=120)
    assert counts == [40] * fs_group.spec.world_size


def test_random_cases_ring_and_without_validation(local_groups):
    # The ring AllGather (forced, tiny chunks so that chunks pipeline) and the unvalidated path.
    group = local_groups.get(
        4,
        backend="freescale",
        setup="freescale_comm:register",
        env={
            "FREESCALE_ALLGATHER": "ring",
            "FREESCALE_CHUNK_BYTES": "16",
            "FREESCALE_VALIDATE": "0",
        },
    )
    assert group.run(ranks.run_random_cases, 2, 30, False, timeout_s=120) == [30] * 4


def test_repeated_shapes_from_the_plan_cache(fs_group):
    n = fs_group.spec.world_size
    assert fs_group.run(ranks.repeated_shapes, 4, timeout_s=120) == [36] * n


def test_cached_calls_keep_no_tensor_alive(fs_group):
    # The plan cache's byte views hold addresses only; a send read from this process's memory
    # is kept alive by its request while it may be read, not by the cache.
    n = fs_group.spec.world_size
    assert fs_group.run(ranks.cached_calls_free_their_tensors, timeout_s=60) == [[True, True]] * n


def test_one_element_tensors_with_any_stride(fs_group):
    # A one-element tensor is contiguous whatever its stride; Gloo takes it, so must we.
    n = fs_group.spec.world_size
    assert fs_group.run(ranks.one_element_strided_tensors, timeout_s=60) == [3] * n


def test_collectives_in_flight_from_threads_on_subgroups_and_two_hosts(fs_group):
    # Up to 6 at once per thread, waited for in a random order, sizes either side of every
    # path's limit, over UCX between the pretend hosts and the rings within each.
    checked = fs_group.run(ranks.concurrent_random_cases, 5, 25, 2, 1_200_000, 2, timeout_s=180)
    assert len(set(checked)) == 1 and checked[0] > 2 * 25, checked


@pytest.mark.parametrize("validate", [True, False])
def test_a_later_collective_never_overtakes_an_earlier_ring_forward(fs_group4, validate):
    # Without validation no header round orders the two: the AllToAll's data sat in the ring
    # ahead of the AllGather's forward, which rank 1 waited for until the timeout.
    assert fs_group4.run(ranks.ring_gather_then_all_to_all, validate, timeout_s=60) == ["ok"] * 4


def test_futures_hold_the_values_gloo_gives(fs_group):
    # An AllGather into one tensor gave [output] (NCCL's form) where Gloo gives the pieces.
    results = fs_group.run(ranks.future_values_like_gloo, timeout_s=60)
    assert results == [[]] * len(results), results


def test_lazy_views_as_inputs_and_autograd_versions_of_outputs_match_gloo(fs_group):
    # A negated view was refused as an input, and outputs kept their version: a backward
    # through a tensor the collective overwrote silently used the new values.
    for seen in fs_group.run(ranks.lazy_views_and_autograd_versions, timeout_s=120):
        assert seen["differ"] == [], seen
        assert all(seen["bumps"].values()), seen
        assert seen["backward"] == "modified by an inplace operation", seen


def test_a_barrier_returns_once_the_collectives_before_it_have_finished(fs_group):
    n = fs_group.spec.world_size
    assert fs_group.run(ranks.outputs_written_when_a_barrier_returns, 3, timeout_s=120) == [3] * n


def test_a_destroy_lets_the_collectives_in_flight_finish(fs_group):
    n = fs_group.spec.world_size
    run = ranks.collectives_in_flight_finish_at_a_destroy
    assert fs_group.run(run, 3, timeout_s=120) == [3] * n


def test_asynchronous_calls_run_in_their_call_or_are_driven_by_their_wait(fs_group):
    # Handed to the engine thread, an asynchronous call and its wait took 2-4x a synchronous
    # call's time (two hand-offs between threads). A small one whose peers' headers are in runs
    # to its end in its call; a larger one's wait takes it back from the engine thread.
    seen = fs_group.run(ranks.asynchronous_calls, 3, timeout_s=120)
    (express_before, express_after), _ = seen[0]["small"]
    assert express_after - express_before == 3, seen[0]
    for rank, result in enumerate(seen):
        (express_before, express_after), driven_here = result["larger"]
        assert express_after == express_before, result  # its reads exceed the inline limit
        if rank != 1:  # rank 1 comes late: the others' waits wait for it
            assert any(driven_here), (rank, result)


def test_a_barrier_in_a_future_callback_does_not_wait_for_later_collectives(fs_group):
    # It waited for the AllGather that rank 0 starts only after its own barrier: the ranks
    # hung until the 20 s timeout.
    assert max(fs_group.run(ranks.barrier_in_a_callback, timeout_s=60)) < 10


def test_small_calls_run_to_their_end_in_their_call(fs_group):
    # The express path (``Collective._express``): results equal Gloo's on it, with and without
    # a cached plan; a late peer, an asynchronous one and a table with a problem fall back to
    # the general path.
    n = fs_group.spec.world_size
    seen = fs_group.run(ranks.express_calls, 6, timeout_s=120)
    assert all(r["first"] >= 4 for r in seen), seen  # of 36
    errors = [r["errors"] for r in seen]
    assert all(len(e) == 1 for e in errors) and len({e[0] for e in errors}) == 1, errors
    assert len(seen) == n


def test_fsdp_trains_as_on_gloo(fs_group):
    # FSDP's first backward raised "Trying to resize storage that is not resizable": the
    # AllGather's output had been shared with numpy, which torch marks as never resizable.
    for result in fs_group.run(ranks.fsdp_trains_as_on_gloo, 4, timeout_s=120):
        assert result["resizable"] == [True] * 4, result
        assert result["freescale"] == result["gloo"], result
