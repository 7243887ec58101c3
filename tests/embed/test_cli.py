"""``freescale embed bench``'s options: bad values refused in one line before any rank starts."""

from __future__ import annotations

import pytest

from freescale_embed import cli
from tests.cli_refusals import assert_refused


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-size", "0"], "argument --world-size: must be at least 1, got 0"),
        (["--collision-rates", "0,2"], "argument --collision-rates: must be in [0, 1], got 2"),
        (["--collision-rates", ","], "argument --collision-rates: needs at least one value"),
        (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
        (["--dense-ms", "-1"], "argument --dense-ms: must be in [0, inf)"),
        (["--num-embeddings", "100"], "num_embeddings (100) must be at least twice rows_per_step"),
        (["--backend", "nccl"], "--backend nccl needs --device cuda"),
        (["--backend", "mpi"], "argument --backend: invalid choice: 'mpi'"),
        (["--dense", "gpu"], "--dense gpu goes with --device cuda"),
    ],
)
def test_bench_refuses_bad_values_in_one_line(argv, message, capsys, tmp_path):
    assert_refused(cli.main, ["bench", *argv, "--out", str(tmp_path)], message, capsys)
    assert not any(tmp_path.iterdir())


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for default in ("0.0,0.01,0.02,0.05,0.1,0.2,0.3,0.5", "(default: 500000)", "(default: gloo)"):
        assert default in out, default
