"""Every CPU-capable benchmark script runs end to end on tiny sizes, and the CUDA-only ones parse
their command line; the bigger scripts have dry runs of their own (``tests/comm/
test_gpu_benchmarks.py``, ``tests/embed/test_train_e2e.py``, ``test_train_torchrec.py``,
``tests/comm/test_liveness.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import reads_allowed

_ROOT = Path(__file__).resolve().parents[1]


def _probe_runs_here() -> bool:
    """Whether ``host_probe_repeat.py`` measures anything here: ranks may read each other's
    memory, and torch's tensors keep 4 KiB pages without ``THP_MEM_ALLOC_ENABLE`` (not under
    the kernel's ``always``)."""
    from freescale_comm.info import transparent_huge_pages

    return reads_allowed() and transparent_huge_pages() != "always"


def _run(script: str, *argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    # The scripts import `benchmarks.*` helpers by the repository's root, as their READMEs run them.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, str(_ROOT / "benchmarks" / script), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=_ROOT,
        check=False,
    )


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("script", "argv", "written"),
    [
        (
            "comm_alternating.py",
            [
                "--ranks",
                "2",
                "--sizes",
                "8,64K",
                "--calls",
                "5",
                "--blocks",
                "1",
                "--work-mib",
                "1",
                "--ops",
                "all_to_all,all_gather,send_recv",
            ],
            "--json",
        ),
        # One rank: no peer, its own pieces only (the row of how host bytes travel says so).
        ("comm_alternating.py", ["--ranks", "1", "--sizes", "8,2M", "--calls", "3"], "--json"),
        (
            "comm_alternating.py",
            ["--ranks", "2", "--sizes", "8,1M", "--calls", "3", "--blocks", "1", "--async-op"],
            "--json",
        ),
        (
            "comm_host_paths.py",
            [
                *("--ranks", "2", "--blocks", "1", "--min-bytes", "4096"),
                *("--max-bytes", "65536", "--factor", "16", "--target-s", "0.01"),
            ],
            "--out",
        ),
        ("comm_host_profile.py", ["--calls", "20", "--blocks", "1", "--profile"], "--json"),
        (
            "comm_first_calls.py",
            [
                *("--ranks", "2", "--size", "64K", "--calls", "2", "--blocks", "2"),
                *("--gap", "other"),
                # The copies alone read the peers' memory, where the kernel allows it.
                *(("--bare",) if reads_allowed() else ()),
            ],
            "--json",
        ),
        # Pieces above the rings' limit: the reads and the own copies are timed too.
        ("comm_host_breakdown.py", ["--calls", "20", "--bytes-per-peer", "1M"], "--json"),
        ("host_copy_bandwidth.py", ["--read-mib", "1", "--copy-mib", "1"], "--json"),
        ("host_probe_repeat.py", ["--ranks", "2", "--repeats", "2"], "--json"),
        ("embed_gpu.py", ["--device", "cpu", "--backend", "gloo", "--quick"], "--out"),
        ("gil_handover.py", ["--bytes", "64K", "--trials", "2"], "--json"),
    ],
)
def test_cpu_benchmark_runs_on_tiny_sizes(tmp_path, script, argv, written):
    if script == "host_probe_repeat.py" and not _probe_runs_here():
        pytest.skip(
            "no probe runs here: the kernel refuses reads, or gives every tensor huge pages"
        )
    target = tmp_path / "out.json" if written == "--json" else tmp_path / "out"
    done = _run(script, *argv, written, str(target), timeout=140)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    files = [target] if target.suffix == ".json" else sorted(target.rglob("*.json"))
    assert files and all(json.loads(f.read_text()) for f in files)
    if script == "comm_alternating.py":  # what each variant's host bytes took, and why
        report = json.loads(target.read_text())
        paths = report["paths"]
        if argv[1] == "1":
            assert paths["freescale"]["path"] == "none", paths
        else:
            assert paths["freescale"]["path"].startswith("shm")
            assert paths["freescale"]["why"].startswith("same host")
        for row in report["rows"]:  # with --work-mib: what a call adds to the work, per group
            if "--work-mib" in argv:
                assert row["freescale_added_us"] == row["freescale_us"] - row["work_us"], row
                assert "gloo_added_us" in row, row
            else:
                assert row["freescale_us"] > 0 and row["gloo_us"] > 0, row
    if script == "host_probe_repeat.py":
        from freescale_comm.host_probe import PROBE_ROUNDS

        probes = json.loads(target.read_text())["probes"]
        assert len(probes) == 2, probes
        for probe in probes:
            # The probe's own time holds its timed rounds, half of each path's at least as long
            # as that path's median (a wrong clock once reported 1-2 ms of a 13 ms probe).
            timed = PROBE_ROUNDS / 2 * (probe["rings_ms"] + probe["reads_ms"])
            assert probe["probe_ms"] >= timed > 0, probe


@pytest.mark.timeout(60)
def test_bench_variants_reads_the_rounds_of_each_variant(tmp_path):
    folder = _ROOT / "benchmarks" / "results" / "comm_cpu" / "many_core_knobs"
    target = tmp_path / "rows.json"
    done = _run(
        "bench_variants.py",
        str(folder),
        "--variants",
        "knob_default,knob_one_thread",
        "--json",
        str(target),
        timeout=50,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(target.read_text())["rows"]
    # Two rounds of each variant per cell (knob_one_thread1 is round 1 of knob_one_thread).
    assert {r["variant"] for r in rows} == {"knob_default", "knob_one_thread"}, rows
    assert all(len(r["paired_ratios"]) == 2 for r in rows), rows
    done = _run("bench_variants.py", str(folder), "--variants", "nothing", timeout=50)
    assert done.returncode == 2 and "no runs of ['nothing']" in done.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "script", ["balance_gpu_layer.py", "train_gpu.py", "train_e2e_syncs.py", "comm_two_hosts.py"]
)
def test_cuda_only_benchmark_parses_its_command_line(script):
    done = _run(script, "--help", timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
