"""``freescale kernels``'s options: bad values and files refused in one line; honest skips."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from freescale_kernels import cli
from tests.cli_refusals import assert_refused


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--world-sizes", "0"], "argument --world-sizes: must be at least 1, got 0"),
        (["bench", "--ops", "foo"], "argument --ops: unknown foo; choose from"),
        (["bench", "--copy-tile", "1,2"], "argument --copy-tile: '1,2' is not bytes,max_rows"),
        (["bench", "--sum-tile", "1,2,3"], "argument --sum-tile: '1,2,3' is not elements,warps"),
        (["bench", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["bench", "--rep-ms", "0"], "argument --rep-ms: must be at least 1"),
        (["plot", "missing.json"], "cannot read missing.json: No such file or directory"),
    ],
)
def test_bad_values_are_refused_in_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_refused(cli.main, argv, message, capsys)


def test_plot_refuses_a_file_that_is_not_a_report(tmp_path, capsys):
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    (tmp_path / "text.json").write_text("not json")
    for name, message in (("other.json", "is not a kernels_bench.json"), ("text.json", "not JSON")):
        with pytest.raises(SystemExit):
            cli.main(["plot", str(tmp_path / name)])
        assert message in capsys.readouterr().err


def test_check_without_a_kernel_runtime_says_why(tmp_path: Path) -> None:
    # Triton is installed here; without CUDA or the interpreter its kernels cannot run, and the
    # check says so instead of claiming there is no Triton. A process of its own: Triton reads
    # TRITON_INTERPRET once, when it first decorates a kernel.
    argv = ["bench", "--quick", "--check", "--world-sizes", "2", "--large-batch", "0"]
    options = ["--ops", "segment_sum", "--rep-ms", "1", "--device", "cpu", "--out", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "freescale_kernels.cli", *argv, *options],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "kernels_bench.json").read_text())
    assert [r["check"] for r in report["results"] if "check" in r] == ["skipped"]
    assert "check skipped: needs CUDA (or TRITON_INTERPRET=1)" in result.stdout
    assert "no triton" not in result.stdout


def test_help_shows_defaults_and_quick_values(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 8,32,128,512; with --quick: 2,8,32)" in out
