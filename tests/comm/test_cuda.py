"""Own collectives on CUDA tensors between real ranks (they share the GPUs there are)."""

from __future__ import annotations

import pytest
import torch

from tests.comm import ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("cuda_path", ["direct", "staged"])
def test_cuda_cases_match_reference(fs_group, cuda_path):
    counts = fs_group.run(ranks.run_cuda_cases, 3, 30, cuda_path, timeout_s=180)
    assert counts == [30] * fs_group.spec.world_size
