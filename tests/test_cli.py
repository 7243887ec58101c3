"""The ``freescale`` command: dispatch to installed components, clear words for missing ones."""

from __future__ import annotations

import json
import subprocess
import sys

from freescale_balance import _freescale_cli


def test_missing_component_names_its_package(monkeypatch, capsys):
    monkeypatch.setattr(_freescale_cli, "entry_points", lambda group: [])
    assert _freescale_cli.main(["embed", "bench"]) == 2
    assert "pip install ./freescale_embed" in capsys.readouterr().err
    assert _freescale_cli.main(["nonsense"]) == 2
    assert "unknown command 'nonsense'" in capsys.readouterr().err


def test_an_interrupted_command_says_so_in_one_line(monkeypatch, capsys):
    # Ctrl-C printed a traceback through the local ranks' launcher.
    class Interrupted:
        name = "comm"

        def load(self):
            def run(argv):
                raise KeyboardInterrupt

            return run

    monkeypatch.setattr(_freescale_cli, "entry_points", lambda group: [Interrupted()])
    assert _freescale_cli.main(["comm", "bench"]) == 130
    assert capsys.readouterr().err == "freescale comm: interrupted\n"


def test_balance_simulate_runs_from_the_installed_command(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from freescale_balance._freescale_cli import main; main()",
            "balance",
            "simulate",
            "--world-sizes",
            "8,64",
            "--max-uih",
            "4096,21504",
            "--steps",
            "4",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "partition time for 32768 samples" in result.stdout
    report = json.loads((tmp_path / "straggler.json").read_text())
    assert {p["world_size"] for p in report["points"]} == {8, 64}
    for point in report["points"]:
        pct = point["straggler_pct"]
        assert pct["fbs"] < pct["none"] and pct["kk"] <= pct["fbs"] + 0.5
    assert (tmp_path / "straggler.png").stat().st_size > 0
