"""``freescale comm``'s options: bad values refused in one line before any rank starts."""

from __future__ import annotations

import pytest
import torch

from freescale_comm import bench, cli
from tests.cli_refusals import assert_refused


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ops", "foo"], "argument --ops: unknown foo; choose from all_gather,all_to_all"),
        # Both measured the same collective twice before.
        (["--ops", "all_gather,,all_to_all"], "argument --ops: an empty name in"),
        (["--ops", "all_gather,all_gather"], "argument --ops: all_gather named more than once"),
        (["--min-bytes", "5X"], "argument --min-bytes: '5X' is not a size"),
        (["--max-bytes", "2G"], "argument --max-bytes: '2G' must be from 1 byte to 1G"),
        (["--min-bytes", "1M", "--max-bytes", "4K"], "--min-bytes (1048576) exceeds --max-bytes"),
        (["--factor", "1"], "argument --factor: must be at least 2, got 1"),
        (["--target-s", "0"], "argument --target-s: must be in (0, inf)"),
        (["--target-s", "nan"], "argument --target-s: must be a finite number, got nan"),
        (["--min-bytes", "inf"], "argument --min-bytes: 'inf' is not a size"),
        (["--max-bytes", "1e400"], "argument --max-bytes: '1e400' is not a size"),
        (["--blocks", "0"], "argument --blocks: must be at least 1"),
        (["--min-calls", "0"], "argument --min-calls: must be at least 1"),
        (["--min-calls", "501"], "--min-calls (501) exceeds 500"),
        (["--threads", "-1"], "argument --threads: must be at least 0"),
    ],
)
def test_bench_refuses_bad_values_in_one_line(argv, message, capsys, tmp_path):
    assert_refused(cli.main, ["bench", *argv, "--out", str(tmp_path)], message, capsys)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ranks", "-1"], "argument --ranks: must be at least 0"),
        # Accepted before, and nothing shown: no pair.
        (["--ranks", "1"], "--ranks: 0 (no ranks) or at least 2 (a pair to show)"),
        # Ignored before.
        (["--hosts", "2"], "--hosts (2) needs --ranks of at least as many"),
        (["--ranks", "2", "--hosts", "3"], "--hosts (3) needs --ranks of at least as many"),
    ],
)
def test_info_refuses_bad_values_in_one_line(argv, message, capsys):
    assert_refused(cli.main, ["info", *argv], message, capsys)


def test_bench_refuses_an_out_it_cannot_make_and_cuda_without_a_device(capsys, tmp_path):
    # Both were found only once ranks ran: --out after the whole sweep, cuda as a traceback.
    taken = tmp_path / "a_file"
    taken.write_text("")
    message = f"--out {taken}: cannot make the folder"
    assert_refused(cli.main, ["bench", "--out", str(taken)], message, capsys)
    # A folder that exists but takes no file (also for root): refused before the sweep, which
    # ran to its end and then failed to write its report.
    message = "--out /proc/self: cannot write there"
    assert_refused(cli.main, ["bench", "--out", "/proc/self"], message, capsys)
    if not torch.cuda.is_available():
        message = "--device cuda: this machine has no CUDA device torch can use"
        assert_refused(
            cli.main, ["bench", "--device", "cuda", "--out", str(tmp_path)], message, capsys
        )


def test_help_names_the_collectives_the_bench_measures(capsys):
    assert cli._OPS == bench.OPS
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: all_gather,all_to_all)" in out and "(default: 64M)" in out


def test_bench_refuses_more_threads_than_cores(capsys, tmp_path):
    from freescale_comm.cpu import usable_cores

    too_many = str(usable_cores() + 1)
    message = f"--threads ({too_many}) exceeds the {usable_cores()} cores this may use"
    assert_refused(
        cli.main, ["bench", "--threads", too_many, "--out", str(tmp_path)], message, capsys
    )


@pytest.mark.parametrize("command", ["info", "bench"])
def test_a_bad_option_in_the_environment_is_refused_in_one_line(command, capsys, monkeypatch):
    # Each rank raised it as a traceback (bench: after the ranks started).
    monkeypatch.setenv("FREESCALE_EAGER_BYTES", "abc")
    message = "environment: FREESCALE_EAGER_BYTES='abc' is not a valid int"
    assert_refused(cli.main, [command], message, capsys)
