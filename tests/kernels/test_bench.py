"""``freescale kernels bench`` runs end to end at smoke-test sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from freescale_kernels import bench, cli


def test_quick_bench_writes_json_and_plots(tmp_path: Path) -> None:
    code = cli.main(
        [
            "bench",
            "--quick",
            "--providers",
            "reference,naive",
            "--rep-ms",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    report = json.loads((tmp_path / "kernels_bench.json").read_text())
    assert report["meta"]["copy_gbps"] > 0
    timed = [r for r in report["results"] if r.get("ms")]
    assert {r["op"] for r in timed} == set(bench.OPS)
    assert {r["provider"] for r in timed} == {"reference", "naive"}
    assert not [r for r in report["results"] if "error" in r]
    pytest.importorskip("matplotlib")
    assert {p.name for p in tmp_path.glob("*.png")} == {f"{op}.png" for op in bench.OPS}


def test_check_runs_the_kernels_against_the_reference(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    code = cli.main(
        [
            "bench",
            "--quick",
            "--check",
            "--world-sizes",
            "8",
            "--local-batch",
            "16",
            "--providers",
            "reference",
            "--rep-ms",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    report = json.loads((tmp_path / "kernels_bench.json").read_text())
    checks = [(r["op"], r["check"]) for r in report["results"] if "check" in r]
    assert {op for op, _ in checks} == set(bench.OPS)
    assert all(check == "pass" for _, check in checks), checks
    assert code == 0


def test_plot_redraws_a_saved_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = bench.BenchConfig.quick(
        world_sizes=(2, 4), ops=("ranged_dispatch",), providers=("reference",), rep_ms=1
    )
    report = bench.run(config)
    report["results"] += [
        dict(r, provider="triton", ms=r["ms"] / 2, gbps=r["gbps"] * 2) for r in report["results"]
    ]
    bench.write_report(report, tmp_path / "run")
    assert cli.main(["plot", str(tmp_path / "run" / "kernels_bench.json")]) == 0
    assert "2.0x over vectorized eager" in capsys.readouterr().out


def test_failing_provider_is_recorded_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(bench.naive, "keyed_transpose", broken)
    config = bench.BenchConfig.quick(
        world_sizes=(2,), ops=("keyed_transpose",), providers=("reference", "naive"), rep_ms=1
    )
    report = bench.run(config)
    errors = [r for r in report["results"] if "error" in r]
    assert len(errors) == 2 and all("boom" in r["error"] for r in errors)  # ids and rows
    assert "boom" in bench.format_table(report)
    bench.write_report(report, tmp_path)
    assert (tmp_path / "kernels_bench.json").exists()
