"""Starting ``freescale train``'s ranks: under torchrun, or as local processes it starts itself."""

from __future__ import annotations

import os
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from freescale_embed.bench import launch_ranks
from freescale_embed.train.config import RunConfig, TrainConfig
from freescale_embed.train.data import open_data
from freescale_embed.train.job import train_run


def under_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _runs_on_this_rank(
    config: TrainConfig, runs: Sequence[RunConfig], out: Path
) -> list[dict[str, Any]]:
    torch.set_num_threads(config.threads)
    if config.deterministic:
        # cuBLAS reads it when it starts, which is after this point.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    data = open_data(config)
    return [train_run(config, run, data, out) for run in runs]


def _local_rank_main(
    rank: int, port: int, queue: Any, config: TrainConfig, runs: Sequence[RunConfig], out: Path
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(config.threads))
    try:
        timeout = timedelta(seconds=config.timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=config.world_size, timeout=timeout
        )
        summaries = _runs_on_this_rank(config, runs, out)
        dist.destroy_process_group()
        queue.put((rank, "ok", summaries))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run_training(
    config: TrainConfig, runs: Sequence[RunConfig], out: Path, timeout_s: float = 3600.0
) -> list[dict[str, Any]] | None:
    """Trains every run on every rank; returns the runs' summaries (``None`` on ranks > 0 under
    torchrun)."""
    if under_torchrun():
        dist.init_process_group("gloo", timeout=timedelta(seconds=config.timeout_s))
        world = config.with_world_size(dist.get_world_size())
        summaries = _runs_on_this_rank(world, runs, out)
        rank = dist.get_rank()
        dist.destroy_process_group()
        return summaries if rank == 0 else None
    open_data(config)  # a missing dataset is reported here, before any rank starts
    replies = launch_ranks(
        _local_rank_main, config.world_size, (config, tuple(runs), out), timeout_s, True
    )
    for rank, (kind, payload) in sorted(replies.items()):
        if kind != "ok":
            raise RuntimeError(f"freescale train: rank {rank} failed:\n{payload}")
    missing = sorted(set(range(config.world_size)) - set(replies))
    if missing:
        raise TimeoutError(f"freescale train: ranks {missing} did not finish in {timeout_s:.0f} s")
    return replies[0][1]
