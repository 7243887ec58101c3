"""``benchmarks/train_e2e.py`` as a small CPU dry run, what its one-rank-per-GPU part refuses
and reports, and the scale simulation's logic."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from freescale_balance import partition_or_keep
from freescale_embed.train.scale import ScaleConfig, against_baseline, simulate, summarize_steps

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_e2e.py"


def _benchmark():
    spec = importlib.util.spec_from_file_location("train_e2e", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(600)
def test_dry_run_measures_every_configuration_and_checks_exactness(tmp_path, capsys):
    bench = _benchmark()
    argv = ["--out", str(tmp_path), "--quick", "--cpu-worlds", "2", "--cpu-steps", "5"]
    assert bench.main([*argv, "--parts", "cpu,scale,collisions"]) == 0
    printed = capsys.readouterr().out
    results = json.loads((tmp_path / "e2e.json").read_text())
    setting = results["settings"]["cpu_2ranks"]
    assert [r["label"] for r in setting["rows"]] == [label for label, _ in bench.CPU_RUNS]
    exact = setting["exactness"]
    assert exact["all_bitwise"] and exact["losses_agree"]
    assert set(exact["prioritized_equals_sync_bitwise"]) == {
        "+prioritized == baseline",
        "FBS+prioritized == +FBS",
    }
    for r in setting["rows"]:
        assert r["step_ms"] > 0 and r["samples_per_s"] > 0
        assert (r["prefetch_mb"] > 0) == (r["run"]["mode"] == "prioritized")
    assert len(results["scale"]["points"]) == 4 and len(results["collisions"]) == 2 * 3
    assert (tmp_path / "ablation.png").exists() and (tmp_path / "scale.png").exists()
    # The tables come last, the simulation's at the end.
    assert printed.rstrip().splitlines()[-1].startswith("wall")
    assert "== simulated ranks" in printed and "target:" in printed


def test_kept_batches_reuse_the_baseline_ranks_times():
    # min_gain 0.99: no partition gains that much, every policy keeps the loaded assignment.
    config = ScaleConfig(
        world_sizes=(2,), max_histories=(32,), local_batch=3, steps=2, embedding_dim=8,
        num_layers=1, num_heads=1, num_negatives=4, num_items=300, device="cpu", min_gain=0.99,
    )  # fmt: skip
    point = simulate(config)["points"][0]
    times = point["rank_times_s"]
    assert all(times[p] == times["none"] for p in ("fbs", "kk", "vbs"))
    assert point["reused_rank_times"] == 2 * 2 * 3  # steps x ranks x balanced policies


def test_partition_or_keep_balances_only_when_it_gains_enough():
    costs = torch.tensor([10.0, 10.0, 1.0, 1.0])
    loaded = torch.tensor([0, 0, 1, 1])
    assert not torch.equal(partition_or_keep(costs, 2, "fbs", [2, 2], 0.2).ranks, loaded)
    even = torch.tensor([10.0, 9.0, 9.5, 9.5])
    assert torch.equal(partition_or_keep(even, 2, "fbs", [2, 2], 0.2).ranks, loaded)


def test_bubble_and_speedup_against_the_baseline():
    none = summarize_steps([[1.0, 3.0]])  # max 3, mean 2: bubble 1
    fbs = summarize_steps([[2.0, 2.2]])  # max 2.2, mean 2.1: bubble 0.1
    assert none["straggler_pct"] == pytest.approx(100 / 3)
    versus = against_baseline({"policies": {"none": none, "fbs": fbs}})["fbs"]
    assert versus["bubble_reduction_pct"] == pytest.approx(90.0)
    assert versus["speedup"] == pytest.approx(3 / 2.2)


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
