"""``freescale balance simulate`` refuses bad values in one line, before simulating."""

from __future__ import annotations

import pytest

from freescale_balance import cli
from tests.cli_refusals import assert_refused


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "2"], "--steps (2) must exceed --warmup-steps (3)"),
        (["--world-sizes", "0"], "argument --world-sizes: must be at least 1, got 0"),
        (["--world-sizes", "8,x"], "argument --world-sizes: 'x' is not an integer"),
        (["--max-uih", ","], "argument --max-uih: needs at least one value"),
        (["--sigma", "0"], "argument --sigma: must be in (0, inf)"),
        (["--median-fraction", "2"], "argument --median-fraction: must be in (0, 1]"),
        (["--local-batch", "0"], "argument --local-batch: must be at least 1"),
    ],
)
def test_bad_values_are_refused_in_one_line(argv, message, capsys, tmp_path):
    assert_refused(cli.main, ["simulate", *argv, "--out", str(tmp_path)], message, capsys)
    assert not any(tmp_path.iterdir())


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["simulate", "--help"])
    out = capsys.readouterr().out
    for default in ("8,16,32,64,128,256", "(default: 8)", "(default: 3)", "out/balance_simulate"):
        assert default in " ".join(out.split()), default


def test_steps_after_warmup_run(tmp_path, capsys):
    argv = ["simulate", "--world-sizes", "8", "--max-uih", "1024", "--steps", "2"]
    assert cli.main([*argv, "--warmup-steps", "1", "--out", str(tmp_path)]) == 0
    assert "partition time" in capsys.readouterr().out
