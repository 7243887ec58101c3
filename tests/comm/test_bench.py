"""``freescale comm bench``: which backends it compares, and a small sweep end to end (CPU)."""

from __future__ import annotations

import json

import pytest

from freescale_comm.bench import BenchConfig
from freescale_comm.cli import main
from freescale_comm.info import page_rule, tensors_get_huge_pages, transparent_huge_pages


def test_backends_by_device_and_gpu_count():
    assert BenchConfig().backends(0) == ("freescale", "gloo")
    cuda = BenchConfig(device="cuda", world_size=2)
    # NCCL refuses two ranks on one GPU: it joins only where every rank has its own.
    assert cuda.backends(1) == ("freescale_ipc", "freescale_direct", "freescale_staged")
    assert cuda.backends(2) == ("freescale_ipc", "freescale_direct", "freescale_staged", "nccl")


def test_sizes_are_the_bytes_measured_each_once():
    # Whole float32 elements, as many for every rank: at 3 ranks 8 and 16 bytes both measure
    # 12, and 64 measures 60.
    assert BenchConfig(world_size=3, min_bytes=8, max_bytes=64).sizes() == [12, 24, 60]
    assert BenchConfig(world_size=2, min_bytes=4096, max_bytes=16384).sizes() == [4096, 8192, 16384]


def test_small_sweep_is_correct_and_reported(tmp_path, capsys):
    assert (
        main(
            [
                "bench",
                "--world-sizes",
                "2",
                "--min-bytes",
                "4K",
                "--max-bytes",
                "16K",
                "--factor",
                "4",
                "--blocks",
                "2",
                "--warmup",
                "1",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "comm_bench.json").read_text())["reports"][0]
    assert report["backends"] == ["freescale", "gloo"]
    assert [(r["op"], r["size"]) for r in report["rows"]] == [
        ("all_gather", 4096),
        ("all_gather", 16384),
        ("all_to_all", 4096),
        ("all_to_all", 16384),
    ]
    assert all(r["correct"] for r in report["rows"])
    # The path freescale's host bytes took, and how it was chosen (the rings' limit).
    assert report["host_path"]["path"].startswith("shm")
    assert report["host_path"]["why"].startswith("same host")
    out = capsys.readouterr().out
    assert "fs/gloo" in out
    assert "freescale's host bytes to the next rank: shm" in out


@pytest.mark.skipif(
    transparent_huge_pages() in ("never", "unknown"), reason="the kernel offers no huge pages"
)
@pytest.mark.parametrize("huge_pages", [False, True])
def test_huge_pages_are_asked_for_the_ranks_tensors_only_with_the_flag(
    tmp_path, monkeypatch, huge_pages
):
    # The flag alone decides, whatever the launching environment says.
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0" if huge_pages else "1")
    flag = ["--huge-pages"] if huge_pages else []
    argv = ["bench", "--min-bytes", "4M", "--max-bytes", "4M", "--ops", "all_to_all"]
    argv += ["--blocks", "1", "--warmup", "1", "--target-s", "0.01", "--out", str(tmp_path)]
    assert main(argv + flag) == 0
    report = json.loads((tmp_path / "comm_bench.json").read_text())["reports"][0]
    (row,) = report["rows"]
    assert row["correct"]
    assert report["config"]["huge_pages"] is huge_pages
    # torch's madvise marks the mapping whatever the kernel then finds free.
    assert row["pages"]["input"]["advised"] is huge_pages
    assert row["pages"]["output"]["advised"] is huge_pages


@pytest.mark.parametrize(
    ("torch_asks", "mode", "says"),
    [
        (True, "madvise", "huge pages for the 2 MiB-aligned stretches"),
        (False, "madvise", "4 KiB pages (kernel: madvise; with THP_MEM_ALLOC_ENABLE=1 torch asks"),
        (False, "always", "huge pages wherever the kernel has them free"),
        (True, "never", "4 KiB pages (the kernel's transparent huge pages are off)"),
        (True, "unknown", "its mode is unknown"),
    ],
)
def test_info_names_the_pages_of_torchs_tensors(torch_asks, mode, says):
    assert says in page_rule(torch_asks, mode)


@pytest.mark.parametrize(
    ("torch_asks", "mode", "huge"),
    [
        (False, "always", True),
        (True, "always", True),
        (True, "madvise", True),
        (False, "madvise", False),
        (True, "never", False),
        (True, "unknown", False),
    ],
)
def test_which_tensors_get_huge_pages(torch_asks, mode, huge):
    assert tensors_get_huge_pages(torch_asks, mode) is huge


@pytest.mark.parametrize(
    ("global_mode", "size_mode", "mode"),
    [
        ("always [madvise] never", "always [inherit] madvise never", "madvise"),
        ("always [madvise] never", "always inherit madvise [never]", "never"),
        ("[always] madvise never", None, "always"),
        (None, None, "unknown"),
    ],
)
def test_the_huge_page_mode_of_2_mib_pages_overrides_the_global_one(
    tmp_path, global_mode, size_mode, mode
):
    if global_mode is not None:
        (tmp_path / "enabled").write_text(global_mode + "\n")
    if size_mode is not None:
        (tmp_path / "hugepages-2048kB").mkdir()
        (tmp_path / "hugepages-2048kB" / "enabled").write_text(size_mode + "\n")
    assert transparent_huge_pages(str(tmp_path)) == mode


@pytest.mark.parametrize("value", ["0", "1", "2,0", "x", ""])
def test_bad_world_sizes_are_refused(value, capsys):
    with pytest.raises(SystemExit) as refused:
        main(["bench", "--world-sizes", value])
    assert refused.value.code == 2
    assert "--world-sizes" in capsys.readouterr().err
