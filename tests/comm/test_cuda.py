"""Own collectives on CUDA tensors between real ranks (they share the GPUs there are)."""

from __future__ import annotations

import pytest
import torch

from tests.comm import ipc_ranks, ranks
from tests.comm.conftest import FAST_FAILURE_ENV, SETUP
from tests.harness import LocalGroup, RankFailure

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    ("cuda_path", "hosts"),
    [("direct", 1), ("staged", 1), ("staged", 4), ("ipc", 1), ("ipc", 2), ("auto", 2)],
    ids=["direct", "staging-rings", "staged-over-ucx", "ipc", "ipc-and-staged", "ipc-and-direct"],
)
def test_cuda_cases_match_reference(fs_group, cuda_path, hosts):
    # hosts=4: every rank looks as if on a host of its own (no rings: the UCX staged pipeline).
    # hosts=2 (4 ranks): IPC within each pretend host, and in the same collectives the staged
    # pipeline ("ipc") or UCX device messages ("auto") between them.
    n = fs_group.spec.world_size
    reports = fs_group.run(ranks.run_cuda_cases, 3, 30, cuda_path, hosts, timeout_s=180)
    for rank, report in enumerate(reports):
        assert report["cases"] == 30
        for peer, (path, pushes) in report["paths"].items():
            same_host = rank * hosts // n == peer * hosts // n
            if cuda_path in ("ipc", "auto") and same_host:
                assert path == "ipc" and pushes > 0, (rank, peer, path, pushes)
            else:
                want = "staged" if cuda_path in ("staged", "ipc") else "direct"
                assert path == want and pushes == 0, (rank, peer, path, pushes)


@pytest.mark.parametrize("host_path", ["auto", "shm"])
def test_staged_ring_all_gather_between_hosts(fs_group4, host_path):
    # The pipeline's chunks to a neighbour on the same pretend host take UCX, which matches
    # them by tag: over the host ring (read or copied) they stalled until the timeout.
    assert fs_group4.run(ranks.staged_ring_all_gathers, host_path, 6, timeout_s=120) == [6] * 4


@pytest.mark.parametrize(("cuda_path", "validate"), [("ipc", True), ("auto", False)])
def test_a_rank_alone_on_its_host(fs_group4, cuda_path, validate):
    # Ranks 0-2 on one pretend host, rank 3 alone: it reaches every peer by the remote path,
    # the others one another by IPC; without validation only IPC pairs exchange headers.
    hosts = [0, 0, 0, 1]
    reports = fs_group4.run(ranks.run_cuda_cases, 4, 20, cuda_path, hosts, validate, timeout_s=180)
    remote = "staged" if cuda_path == "ipc" else "direct"
    for rank, report in enumerate(reports):
        assert report["cases"] == 20
        for peer, (path, pushes) in report["paths"].items():
            if hosts[rank] == hosts[peer]:
                assert path == "ipc" and pushes > 0, (rank, peer, path, pushes)
            else:
                assert path == remote and pushes == 0, (rank, peer, path, pushes)


@pytest.mark.parametrize(
    ("cuda_path", "validate", "allgather"),
    [("ipc", True, "auto"), ("auto", False, "ring"), ("staged", True, "auto")],
)
def test_a_pair_without_rings(fs_group4, cuda_path, validate, allgather):
    # /dev/shm full when rank 3 makes its ring from rank 1: that pair takes the remote path
    # with each other, every other pair of the host IPC (or the staging rings), and ranks 0
    # and 2 (rings to every peer) make the choices both sides of a pair must share (label,
    # AllGather algorithm, folding, the path of a ring AllGather) as ranks 1 and 3 do.
    reports = fs_group4.run(
        ranks.run_cuda_cases, 5, 20, cuda_path, 1, validate, {3: 1}, allgather, timeout_s=180
    )
    remote = "direct" if cuda_path == "auto" else "staged"
    for rank, report in enumerate(reports):
        assert report["cases"] == 20
        for peer, (path, pushes) in report["paths"].items():
            if {rank, peer} == {1, 3}:
                assert path == remote and pushes == 0, (rank, peer, path, pushes)
                if cuda_path != "staged":
                    assert "no CUDA IPC" in report["why"][peer], report["why"][peer]
            elif cuda_path == "staged":
                assert report["why"][peer].startswith("staged: staging rings"), report["why"]
            else:
                assert path == "ipc" and pushes > 0, (rank, peer, path, pushes)


@pytest.mark.parametrize("cuda_path", ["staged", "ipc", "direct"])
def test_future_callbacks_may_start_collectives_and_wait_for_them(fs_group, cuda_path):
    n = fs_group.spec.world_size
    assert fs_group.run(ranks.nested_future_collectives, 3, cuda_path, timeout_s=120) == [6] * n


@pytest.mark.parametrize("cuda_path", ["staged", "ipc"])
def test_paths_within_a_host(fs_group, cuda_path):
    n = fs_group.spec.world_size
    reports = fs_group.run(ranks.ring_cuda_checks, 5, cuda_path, timeout_s=240)
    for rank, report in enumerate(reports):
        assert report["checked"] == 12
        assert report["mismatch"] == "FreescaleValidationError"
        for row in report["paths"]:
            want = "ipc: copy-engine copies" if cuda_path == "ipc" else "staged: staging rings"
            assert row["cuda"].startswith(want), row
        # Input produced behind ~50 ms of GPU sleep, output consumed and input overwritten on
        # the caller's stream right after the call (sync and async).
        stream = report["stream"]
        for call in stream["calls"].values():
            assert call["correct"], (rank, stream)
            if cuda_path == "ipc":  # wait() returns while the GPU still sleeps
                assert call["call_s"] < stream["sleep_s"] / 2, (rank, stream)
        assert report["kernels"] == [], report["kernels"]
        # Host and staging ring each way per peer and every rank's outbox while the group
        # lives, none after, no files.
        assert report["during"] == {"mapped": 4 * (n - 1) + n, "files": 0}, report["during"]
        assert report["after"] == {"mapped": 0, "files": 0}, report["after"]


@pytest.mark.parametrize("cuda_path", ["ipc", "staged", "direct"])
def test_overlapping_inputs_and_outputs(fs_group, cuda_path):
    want = [
        ["all_to_all_single", "all_to_all", "all_gather_into_tensor"]
    ] * fs_group.spec.world_size
    for elements in (2, 40_000, 300_000):  # pushed / folded, pulled / staged, chunked
        assert fs_group.run(ranks.overlapping_inputs, elements, cuda_path, timeout_s=120) == want


@pytest.mark.parametrize("world_size", [2, 4])
def test_ipc_special_cases(world_size):
    # Fresh ranks: memory cached by earlier tests' segments would not come from the
    # expandable segments this test asks for.
    group = LocalGroup(world_size, backend="freescale", setup=SETUP, init_timeout_s=60)
    try:
        group.start()
        reports = group.run(ranks.ipc_special_cases, 3, timeout_s=180)
    finally:
        group.close()
    for report in reports:
        assert report["exportable_True"] is False  # expandable segments: through the scratch
        for validate in (True, False):
            assert all(p.startswith("ipc:") for p in report[f"paths_{validate}"]), report


def _check_mailbox_pushes(reports: list[dict], world_size: int) -> None:
    from freescale_comm.ipc import MAILBOX_SLOTS

    in_flight, after = range(3 * MAILBOX_SLOTS), range(100, 100 + 2 * MAILBOX_SLOTS)
    small_in_flight = sum(1 for k in in_flight if k % 5 != 4)  # each fifth is over a slot
    small_after = sum(1 for k in after if k % 5 != 4)
    for rank, report in enumerate(reports):
        assert report["checked"] == 1 + len(in_flight) + len(after), report
        assert report["mismatches"] == MAILBOX_SLOTS + 1, report
        # In flight: the first call into each slot pushes, a later one only if its receiver
        # has read the slot by then. After them every small call pushes, and of the
        # mismatches only rank 0's (the others' plans fail locally: they expect more bytes
        # from themselves than they send, and send nothing), which every peer frees unread.
        for pushes in report["pushes_in_flight"]:
            assert MAILBOX_SLOTS <= pushes <= small_in_flight, (rank, report)
        later = small_after + (MAILBOX_SLOTS + 1 if rank == 0 else 0)
        assert len(report["pushes"]) == world_size - 1, report
        for pushes, before in zip(report["pushes"], report["pushes_in_flight"], strict=True):
            assert pushes - before == later, (rank, report)


def test_ipc_pushes_small_sends_into_mailboxes(fs_group):
    reports = fs_group.run(ipc_ranks.ipc_mailbox_cases, 5, timeout_s=180)
    _check_mailbox_pushes(reports, fs_group.spec.world_size)


def test_ipc_pushes_with_one_hardware_queue():
    # CUDA_DEVICE_MAX_CONNECTIONS=1 (as Megatron sets it): every stream of a process shares
    # one hardware queue, so a GPU wait for a peer blocks all of that process's later work.
    # A push that waited on the GPU for its receiver to read the slot could deadlock both
    # ranks with a mailbox's worth of collectives in flight, started while the GPU sleeps
    # (the second one is queued only once the first has run: on a shared GPU, one at a time).
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    group = LocalGroup(2, backend="freescale", setup=SETUP, init_timeout_s=60, env=env)
    try:
        group.start()
        reports = group.run(ipc_ranks.ipc_mailbox_cases, 9, 400_000_000, timeout_s=180)
    finally:
        group.close()
    _check_mailbox_pushes(reports, 2)


def test_ipc_mismatch_behind_a_lagging_receiver_frees_its_slot_in_order(fs_group):
    from freescale_comm.ipc import MAILBOX_SLOTS

    for report in fs_group.run(ipc_ranks.ipc_lagging_receiver_cases, 6, timeout_s=120):
        assert report["checked"] == 3 * MAILBOX_SLOTS, report


def test_ipc_mismatch_with_cpu_tensors_on_one_rank_frees_the_pushed_slots(fs_group):
    from freescale_comm.ipc import MAILBOX_SLOTS

    n = fs_group.spec.world_size
    for report in fs_group.run(ipc_ranks.ipc_mismatch_with_cpu_tensors_cases, 8, timeout_s=120):
        assert report == {"checked": 1 + 2 * MAILBOX_SLOTS * n, "mismatches": n}, report


def test_ipc_flags_hold_past_two_to_the_31_collectives(fs_group):
    for report in fs_group.run(ipc_ranks.ipc_late_sequence_cases, 7, timeout_s=120):
        assert report["checked"] == 4, report


def test_a_returned_ipc_collective_still_fails_at_its_deadline(local_groups):
    group = local_groups.get(2, backend="freescale", setup=SETUP, init_timeout_s=60)
    rank0, rank1 = group.run(ranks.gpu_stalled_past_the_timeout, timeout_s=60)
    assert rank0["returned_s"] < 1.5, rank0
    # Failed at its deadline (3 s, checked each second), not when rank 1's GPU came back (7 s).
    assert rank0["drained_s"] < 5.5, rank0
    assert rank0["after"] != "no error" and rank1["after"] != "no error", (rank0, rank1)


def test_killed_peer_on_ipc_releases_the_gpu():
    group = LocalGroup(2, backend="freescale", setup=SETUP, init_timeout_s=30, env=FAST_FAILURE_ENV)
    try:
        group.start()
        with pytest.raises(RankFailure) as failure:
            group.run(ranks.die_during_ipc_collective, 1, timeout_s=60)
    finally:
        group.close()
    report = str(failure.value)
    assert "rank 1: died" in report
    assert "survivor 0 raised after" in report and "GPU drained after" in report, report


def test_asynchronous_ipc_calls_are_driven_by_their_wait(fs_group):
    # They were left to the engine thread, whose hand-overs cost the caller wake-ups; now their
    # wait takes them back and drives them until they are sealed.
    reports = fs_group.run(ipc_ranks.ipc_asynchronous_calls_driven_by_their_wait, 3, timeout_s=120)
    for rank, report in enumerate(reports):
        assert report["correct"], report
        if rank != 1:  # rank 1 comes late: the others' waits wait for it
            assert any(report["driven_here"]), (rank, report)


def test_ipc_collectives_end_without_a_watcher_thread_unless_awaited(fs_group):
    for report in fs_group.run(ipc_ranks.ipc_end_event_cases, timeout_s=120):
        # A watcher thread woken per synchronous call took the GIL from the caller's next one.
        assert report["finishing_watches_of_20_calls"] == 0, report
        assert report["correct"] and report["future_correct"], report
        # As soon as the GPU is done, not at the next deadline tick (each second).
        assert max(report["futures_after_gpu_s"]) < 0.2, report
        assert report["is_completed_after_gpu"], report
        assert report["synchronize_after_gpu_s"] < 0.2, report
