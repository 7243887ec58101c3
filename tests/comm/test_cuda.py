"""Own collectives on CUDA tensors between real ranks (they share the GPUs there are)."""

from __future__ import annotations

import pytest
import torch

from tests.comm import ranks
from tests.comm.conftest import FAST_FAILURE_ENV, SETUP
from tests.harness import LocalGroup, RankFailure

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    ("cuda_path", "hosts"),
    [("direct", 1), ("staged", 1), ("staged", 4), ("ipc", 1), ("ipc", 2)],
    ids=["direct", "staging-rings", "staged-over-ucx", "ipc", "ipc-two-hosts-stages"],
)
def test_cuda_cases_match_reference(fs_group, cuda_path, hosts):
    # hosts=4: every rank looks as if on a host of its own (no rings: the UCX staged pipeline).
    counts = fs_group.run(ranks.run_cuda_cases, 3, 30, cuda_path, hosts, timeout_s=180)
    assert counts == [30] * fs_group.spec.world_size


@pytest.mark.parametrize("cuda_path", ["staged", "ipc"])
def test_paths_within_a_host(fs_group, cuda_path):
    n = fs_group.spec.world_size
    reports = fs_group.run(ranks.ring_cuda_checks, 5, cuda_path, timeout_s=240)
    for rank, report in enumerate(reports):
        assert report["checked"] == 12
        assert report["mismatch"] == "FreescaleValidationError"
        for row in report["paths"]:
            want = "ipc: copy-engine pulls" if cuda_path == "ipc" else "staged: staging rings"
            assert row["cuda"].startswith(want), row
        # Input produced behind ~50 ms of GPU sleep, output consumed and input overwritten on
        # the caller's stream right after the call (sync and async).
        stream = report["stream"]
        for call in stream["calls"].values():
            assert call["correct"], (rank, stream)
            if cuda_path == "ipc":  # wait() returns while the GPU still sleeps
                assert call["call_s"] < stream["sleep_s"] / 2, (rank, stream)
        assert report["kernels"] == [], report["kernels"]
        # Host and staging ring each way per peer while the group lives, none after, no files.
        assert report["during"] == {"mapped": 4 * (n - 1), "files": 0}, report["during"]
        assert report["after"] == {"mapped": 0, "files": 0}, report["after"]


def test_ipc_special_cases(fs_group):
    for report in fs_group.run(ranks.ipc_special_cases, 3, timeout_s=180):
        assert report["exportable_True"] is False  # expandable segments: through the scratch
        for validate in (True, False):
            assert all(p.startswith("ipc:") for p in report[f"paths_{validate}"]), report


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
