"""``benchmarks/train_e2e.py``'s one-rank-per-GPU part: what it refuses and how it reports."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_e2e.py"


def _benchmark():
    spec = importlib.util.spec_from_file_location("train_e2e_gpus", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_unknown_part_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _benchmark().main(["--out", str(tmp_path), "--parts", "cpu,gpu"])
    assert "--parts: unknown gpu" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2+ GPUs")
def test_gpus_part_needs_two_gpus_before_anything_runs(tmp_path):
    with pytest.raises(SystemExit, match="needs 2 or more GPUs"):
        _benchmark().main(["--out", str(tmp_path / "run"), "--parts", "cpu,gpus"])
    assert not (tmp_path / "run" / "cpu_2ranks").exists()


def test_gpu_runs_start_from_nccl_and_pair_prioritized_with_sync():
    bench = _benchmark()
    runs = dict(bench.GPU_RUNS)
    assert runs["baseline"] == "nccl:none:sync"
    assert runs["FreeScale (all)"] == "freescale:fbs:prioritized"
    for prioritized, sync in bench.BITWISE_PAIRS:
        assert prioritized in runs and sync in runs


def test_scaling_efficiency_is_samples_per_gpu_against_the_smallest_count():
    def setting(rate: float) -> dict:
        return {"rows": [{"label": "baseline", "samples_per_s": rate}]}

    text = _benchmark().gpu_scaling({"gpus_2": setting(100.0), "gpus_8": setting(300.0)})
    assert "2:      100 (1.00)" in text
    assert "8:      300 (0.75)" in text
    assert _benchmark().gpu_scaling({"gpus_2": setting(1.0)}) == ""
