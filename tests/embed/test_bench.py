"""``freescale embed bench`` runs end to end from the installed command (a small configuration)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_writes_json_and_plot_and_checks_exactness(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from freescale_embed._freescale_cli import main; sys.exit(main())",
            "embed",
            "bench",
            "--collision-rates",
            "0,0.5",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--num-embeddings",
            "5000",
            "--rows-per-step",
            "512",
            "--dense-ms",
            "5",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "embed_bench.json").read_text())
    assert [p["collision_rate"] for p in report["points"]] == [0.0, 0.5]
    for point in report["points"]:
        assert point["exact"]
        assert point["sync"]["exposed_ms"] > 0 and point["prioritized"]["prefetch_mb"] > 0
    assert abs(report["points"][1]["prioritized"]["collision_pct"] - 50.0) < 1.0
    assert (tmp_path / "embed_bench.png").stat().st_size > 0
    assert "exact" in result.stdout
