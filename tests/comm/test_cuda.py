"""Own collectives on CUDA tensors between real ranks (they share the GPUs there are)."""

from __future__ import annotations

import pytest
import torch

from tests.comm import ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    ("cuda_path", "hosts"),
    [("direct", 1), ("staged", 1), ("staged", 4)],
    ids=["direct", "staging-rings", "staged-over-ucx"],
)
def test_cuda_cases_match_reference(fs_group, cuda_path, hosts):
    # hosts=4: every rank looks as if on a host of its own (no rings: the UCX staged pipeline).
    counts = fs_group.run(ranks.run_cuda_cases, 3, 30, cuda_path, hosts, timeout_s=180)
    assert counts == [30] * fs_group.spec.world_size


def test_staging_rings(fs_group):
    n = fs_group.spec.world_size
    for rank, report in enumerate(fs_group.run(ranks.ring_cuda_checks, 5, timeout_s=240)):
        assert report["checked"] == 12
        assert report["mismatch"] == "FreescaleValidationError"
        for row in report["paths"]:
            assert row["cuda"].startswith("staged: staging rings"), row
        # Input produced behind ~50 ms of GPU sleep, output consumed and input overwritten on
        # the caller's stream right after the call (sync and async).
        stream = report["stream"]
        for call in stream["calls"].values():
            assert call["correct"], (rank, stream)
        assert report["kernels"] == [], report["kernels"]
        # Host and staging ring each way per peer while the group lives, none after, no files.
        assert report["during"] == {"mapped": 4 * (n - 1), "files": 0}, report["during"]
        assert report["after"] == {"mapped": 0, "files": 0}, report["after"]
