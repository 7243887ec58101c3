"""``freescale train`` end to end on 2 local ranks it starts itself, and its report and errors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch.distributed as dist

from freescale_embed.train import cli
from freescale_embed.train import job as _job
from freescale_embed.train.config import FREESCALE, TrainConfig, auto_mode, shared_cores
from freescale_embed.train.report import table

_SMALL = [
    "--steps", "6", "--batch-size", "8", "--max-history", "32", "--users", "256",
    "--items", "256", "--negatives", "8", "--dim", "16", "--eval-users", "32",
]  # fmt: skip


def test_freescale_train_runs_both_runs_side_by_side_and_draws_them(tmp_path, capsys):
    out = tmp_path / "train"
    assert cli.main([*_SMALL, "--out", str(out), "--checkpoint-dir", str(tmp_path / "ck")]) == 0
    printed = capsys.readouterr().out
    assert "loss curves of baseline and freescale: agree" in printed
    summaries = json.loads((out / "summary.json").read_text())
    assert [s["run"]["name"] for s in summaries] == ["baseline", "freescale"]
    # FreeScale's mode is auto: prioritized only where each rank has a core to spare.
    mode, why = auto_mode(_job._usable_cores(), 2, 1)
    assert summaries[1]["run"]["mode"] == mode and summaries[1]["mode_auto"] == why
    assert summaries[0]["mode_auto"] is None
    assert f"freescale: mode auto chose {mode} ({why})" in printed
    for summary in summaries:
        assert summary["steps"] == 6 and len(summary["losses"]) == 6
        assert summary["eval_users"] == 32
        lines = (out / summary["run"]["name"] / "steps.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == list(range(1, 7))
    assert (tmp_path / "ck" / "freescale" / ".metadata").exists()
    # 2 ranks of one torch thread: FreeScale balanced, unless this machine has one core.
    shared = shared_cores(_job._usable_cores(), 2, 1)
    assert summaries[1]["balancing"]["balanced"] == (shared is None)
    assert ("did not balance" in printed) == (shared is not None)
    summaries[1]["balancing"] = {"balanced": False, "skipped": "the reason"}
    assert "freescale: did not balance (the reason)" in table(summaries)
    assert cli.main(["report", str(out)]) == 0
    assert (out / "report.png").stat().st_size > 10_000


def test_prioritized_mode_trains_the_same_bits_as_sync(tmp_path, capsys):
    runs = "gloo:kk:sync,freescale:kk:prioritized"
    assert cli.main([*_SMALL, "--out", str(tmp_path), "--runs", runs]) == 0
    assert "agree, weights bitwise equal" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("cores", "local_ranks", "threads", "mode"),
    [(2, 2, 1, "sync"), (3, 2, 1, "sync"), (4, 2, 1, "prioritized"), (16, 2, 1, "prioritized"),
     (8, 2, 4, "sync"), (10, 2, 4, "prioritized"), (1, 1, 1, "sync")],
)  # fmt: skip
def test_auto_mode_is_prioritized_only_with_a_spare_core_per_rank(
    cores, local_ranks, threads, mode
):
    chosen, why = auto_mode(cores, local_ranks, threads)
    assert chosen == mode
    assert f"{cores} cores, {local_ranks} local ranks, torch threads per rank: {threads}" in why


def test_auto_resolves_by_this_hosts_cores_and_an_explicit_mode_stays(monkeypatch):
    # A world of one: the agreement is this rank's own choice; LOCAL_WORLD_SIZE counts the
    # host's ranks as torchrun sets it.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for cores, mode in ((16, "prioritized"), (4, "prioritized"), (3, "sync")):
            monkeypatch.setattr(_job, "_usable_cores", lambda cores=cores: cores)
            run, why = _job._chosen_mode(FREESCALE, TrainConfig())
            assert (run.mode, why) == auto_mode(cores, 2, 1)
            assert run.mode == mode and run.name == FREESCALE.name
        explicit = replace(FREESCALE, mode="prioritized")
        assert _job._chosen_mode(explicit, TrainConfig()) == (explicit, None)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("cores", "local_ranks", "threads", "shared"),
    [(2, 2, 1, False), (2, 4, 1, True), (16, 4, 4, False), (16, 4, 5, True), (1, 1, 1, False)],
)  # fmt: skip
def test_ranks_share_cores_where_their_torch_threads_outnumber_them(
    cores, local_ranks, threads, shared
):
    why = shared_cores(cores, local_ranks, threads)
    assert (why is not None) == shared
    if shared:
        assert f"{local_ranks} local ranks of {threads} torch thread" in why
        assert f"share {cores} cores" in why


def test_a_run_does_not_balance_ranks_that_share_their_compute(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        config = TrainConfig()
        monkeypatch.setattr(_job, "_usable_cores", lambda: 2)
        host = _job._host_ranks_and_cores()
        assert host == (4, 2)
        assert _job._shared_compute(FREESCALE, config, False, host) == shared_cores(2, 4, 1)
        none = replace(FREESCALE, policy="none")
        assert _job._shared_compute(none, config, False, host) is None
        assert _job._shared_compute(FREESCALE, config, True, host) == "ranks share a GPU"
        assert _job._shared_compute(FREESCALE, config, False, (4, 4)) is None
        # Without LOCAL_WORLD_SIZE: the ranks of this host identity (this one).
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        assert _job._host_ranks_and_cores() == (1, 2)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-size", "0"], "world_size must be >= 1"),
        (["--runs", "gloo:fbs:eager"], "mode must be one of"),
        (["--batch-size", "7"], "must split evenly over 2 ranks"),
        (["--runs", "gloo:lpt:sync"], "policy must be one of"),
        (["--items", "64"], "num_items (64) must exceed"),
    ],
)
def test_bad_options_are_refused_before_any_rank_starts(capsys, argv, message):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_report_of_a_folder_without_runs_says_so(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "no run under" in capsys.readouterr().err
