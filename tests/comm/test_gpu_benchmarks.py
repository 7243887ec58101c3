"""The GPU benchmarks on CPU: ``multi_gpu_vs_nccl.py``'s dry run (a rank dying mid-phase
included), the overlap rounds' schedule, the other scripts' command lines, and
``comm_host_breakdown.py`` on CPU tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.overlap_rounds import ALONE, CONTROL, ModeDropped, alternated_rounds

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(script: str, *argv: str, env: dict[str, str] | None = None, timeout: float = 60):
    return subprocess.run(
        [sys.executable, str(_BENCHMARKS / script), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.mark.timeout(420)
def test_dry_run_retries_without_the_backend_whose_rank_died(tmp_path):
    # Rank 1 exits in the sweep while fs_staged runs: the phase ends at once (no wait for rank 0,
    # blocked in a collective), and the retry runs the unfinished parts without fs_staged.
    argv = ["--dry-run", "--out", str(tmp_path), "--no-p2p-phase", "--rounds", "1"]
    argv += ["--sections", "setup,sweep,overlap", "--max-bytes", "512"]
    done = _run(
        "multi_gpu_vs_nccl.py",
        *argv,
        env={"MULTI_GPU_BENCH_CRASH": "sweep:fs_staged"},
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "multi_gpu_vs_nccl.json").read_text())
    main, retry = report["phases"]["main"], report["phases"]["main_retry"]
    assert not main["completed"] and main["last_progress"] == ["sweep", "fs_staged"]
    assert any("rank 1 exited early in sweep" in str(e) for e in main["rank_errors"])
    assert main["retried_without"] == {"backend": "fs_staged", "stopped_in": "sweep"}
    assert retry["completed"] and retry["backends"] == ["fs_ipc", "fs_direct", "nccl", "nccl_ce"]
    assert set(retry["sections"]) == {"setup", "sweep", "overlap"}
    rows = retry["sections"]["sweep"]["result"]["rows"]
    assert rows and all(r["correct"] for r in rows)
    assert {r["backend"] for r in rows} == {"fs_ipc", "fs_direct", "nccl"}
    combos = retry["sections"]["overlap"]["result"]["combos"]
    assert combos and all(
        set(c["slowdown_pct_mean"]) == {"fs_ipc", "fs_direct", "nccl", CONTROL} for c in combos
    )
    assert report["summary"]["sweep_incorrect"] == []
    assert (tmp_path / "table.txt").read_text().rstrip().splitlines()[-1].startswith("elapsed")


@pytest.mark.timeout(200)
def test_dry_run_with_a_shared_gpu_runs_every_freescale_path_and_no_nccl(tmp_path):
    argv = ["--dry-run", "--share-gpu", "--out", str(tmp_path), "--rounds", "1"]
    done = _run("multi_gpu_vs_nccl.py", *argv, "--max-bytes", "512", timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "multi_gpu_vs_nccl.json").read_text())
    assert list(report["phases"]) == ["main"]  # the NCCL-only phase is left out
    main = report["phases"]["main"]
    assert main["completed"] and main["backends"] == ["fs_ipc", "fs_direct", "fs_staged"]
    rows = main["sections"]["sweep"]["result"]["rows"]
    assert rows and all(r["correct"] for r in rows)
    assert {r["backend"] for r in rows} == {"fs_ipc", "fs_direct", "fs_staged"}
    assert all(row["all_ok"] for row in main["sections"]["correctness"]["result"]["rows"])
    assert report["embed"]["status"].startswith("not run")
    assert "no NCCL with --share-gpu" in (tmp_path / "table.txt").read_text()


def test_every_mode_sits_between_windows_alone_in_an_order_that_depends_on_the_seed_only():
    calls: list[str] = []
    times = {ALONE: 10.0, CONTROL: 10.0, "a": 11.0, "b": 12.0}

    def window(mode: str) -> float:
        calls.append(mode)
        return times[mode]

    measured = alternated_rounds(window, ["a", "b"], rounds=4, seed=7)
    assert len(calls) == 4 * 7
    traffic = [i for i, mode in enumerate(calls) if mode != ALONE]
    assert all(calls[i - 1] == ALONE and calls[i + 1] == ALONE for i in traffic)
    assert measured.slowdown_pct() == pytest.approx({"a": 10.0, "b": 20.0, CONTROL: 0.0})
    again: list[str] = []
    alternated_rounds(lambda m: again.append(m) or times[m], ["a", "b"], rounds=4, seed=7)
    assert again == calls


def test_a_dropped_mode_leaves_the_later_rounds_and_a_rank_that_times_nothing_has_no_ratio():
    seen: list[str] = []

    def window(mode: str) -> float | None:
        seen.append(mode)
        if mode == "bad":
            raise ModeDropped(mode)
        return None

    measured = alternated_rounds(window, ["bad", "good"], rounds=3, seed=1)
    assert seen.count("bad") == 1 and seen.count("good") == 3
    assert measured.dropped == ["bad"] and measured.slowdown_pct() == {}


@pytest.mark.parametrize("script", ["comm_gpu.py", "comm_latency.py", "multi_gpu_vs_nccl.py"])
def test_command_line_imports_without_a_gpu(script):
    done = _run(script, "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--out" in done.stdout


def test_host_breakdown_times_every_step_of_a_cpu_collective_on_both_ranks(tmp_path):
    out = tmp_path / "breakdown.json"
    done = _run("comm_host_breakdown.py", "--calls", "20", "--json", str(out), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    ranks = json.loads(out.read_text())["ranks"]
    assert len(ranks) == 2
    for rank in ranks:
        steps = rank["steps"]
        # Every call enters the backend once and starts one collective, of a cached shape
        # after the warm-up: on the express path.
        for label in (
            "ProcessGroupFreescale.all_to_all_single",
            "Collective.start",
            "Collective._express",
        ):
            assert steps[label]["runs_per_call"] == 1.0, steps
        outer = steps["ProcessGroupFreescale.all_to_all_single"]["us_per_call"]
        assert 0 < steps["Collective.start"]["us_per_call"] <= outer


def test_host_breakdown_without_steps_times_the_calls_alone(tmp_path):
    out = tmp_path / "calls.json"
    done = _run(
        "comm_host_breakdown.py", "--calls", "20", "--no-steps", "--json", str(out), timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    ranks = json.loads(out.read_text())["ranks"]
    assert len(ranks) == 2
    assert all(rank["steps"] == {} and rank["us_per_call"] > 0 for rank in ranks), ranks


def test_host_breakdown_with_splits_that_change_on_every_call(tmp_path):
    out = tmp_path / "varying.json"
    argv = ["--calls", "20", "--no-steps", "--vary-splits", "--json", str(out)]
    done = _run("comm_host_breakdown.py", *argv, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    ranks = json.loads(out.read_text())["ranks"]
    assert len(ranks) == 2 and all(rank["us_per_call"] > 0 for rank in ranks), ranks


def test_host_breakdown_reports_blocks_and_a_profile_on_three_ranks(tmp_path):
    out = tmp_path / "blocks.json"
    argv = ["--ranks", "3", "--calls", "30", "--no-steps", "--blocks", "3", "--profile", "5"]
    done = _run("comm_host_breakdown.py", *argv, "--json", str(out), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    ranks = json.loads(out.read_text())["ranks"]
    assert len(ranks) == 3 and all(len(rank["block_us_per_call"]) == 3 for rank in ranks), ranks
    for rank in ranks:  # each rank's 5 functions of most own time
        header, *rows = rank["profile"]
        assert header.split()[:2] == ["ncalls", "tottime"] and len(rows) == 5, rank["profile"]
    assert "blocks of 10 calls: median" in done.stdout and "under cProfile" in done.stdout
