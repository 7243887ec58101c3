"""One rank of ``freescale train``: build the model and data, train each run, evaluate, report."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from freescale_balance import Balancer, BalancerConfig, CostFitConfig, JaggedBatch
from freescale_embed import checkpoint
from freescale_embed.collection import ShardedEmbeddingCollection
from freescale_embed.metrics import hit_rate_and_ndcg, popularity_scores
from freescale_embed.models import SASRec, SASRecConfig, cost_model, item_tables, target_counts
from freescale_embed.optim import RowWiseAdagrad
from freescale_embed.pipeline import (
    PipelineConfig,
    TrainPipeline,
    batch_to_device,
    resident_bytes,
)
from freescale_embed.pipeline_telemetry import StepReport
from freescale_embed.train.config import RunConfig, TrainConfig, auto_mode, shared_cores
from freescale_embed.train.data import Data

_EVAL_BATCH = 64
_TAIL_STEPS = 10  # the final loss is the mean over the last steps (one step is noisy)


def _group(backend: str, timeout: timedelta) -> dist.ProcessGroup:
    """A new group over every rank (collective): each user of one runs on its own thread."""
    if backend == "freescale":
        import freescale_comm  # noqa: F401  (registers the backend)
    return dist.new_group(backend=backend, timeout=timeout)


def _usable_cores() -> int:
    """The cores this process may use: freescale_comm's count (affinity mask capped by a cgroup
    CPU quota) where it is installed, else the affinity mask."""
    try:
        from freescale_comm.cpu import usable_cores
    except ImportError:
        if hasattr(os, "sched_getaffinity"):
            return len(os.sched_getaffinity(0))
        return os.cpu_count() or 1
    return usable_cores()


def _host_identity() -> str:
    """This host's identity as freescale_comm tells hosts apart, else its hostname."""
    try:
        from freescale_comm.shm import host_identity
    except ImportError:
        return socket.gethostname()
    return host_identity()


def _host_ranks_and_cores() -> tuple[int, int]:
    """How many ranks run on this rank's host, and how many cores they may use between them
    (collective). The ranks: ``LOCAL_WORLD_SIZE`` where the launcher sets it (torchrun), else
    those whose host identity is this rank's. The cores: this process's (``_usable_cores``)
    where the host's ranks share one affinity mask, else the union of their masks (ranks
    pinned to cores of their own)."""
    mask = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    mine = (_host_identity(), mask)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    masks = [m for host, m in everyone if host == mine[0]]
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", len(masks)))
    if all(m == mask for m in masks):
        return ranks, _usable_cores()
    return ranks, len(set().union(*masks))


def _chosen_mode(
    run: RunConfig, config: TrainConfig, host: tuple[int, int] | None = None
) -> tuple[RunConfig, str | None]:
    """``run`` with ``mode="auto"`` resolved (``auto_mode``), the same on every rank:
    prioritized only where every host leaves each of its ranks a spare core. ``host``: this
    host's ranks and cores (``_host_ranks_and_cores``; asked here if not given). Returns the run
    and why this rank's host chose its mode (``None`` for an explicit mode; the summary keeps
    rank 0's)."""
    if run.mode != "auto":
        return run, None
    local_ranks, cores = host if host is not None else _host_ranks_and_cores()
    mode, why = auto_mode(cores, local_ranks, config.threads)
    everywhere = torch.tensor([mode == "prioritized"], dtype=torch.int32)
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    if mode == "prioritized" and not everywhere.item():
        mode, why = "sync", "some rank has no spare core for prioritized mode's background thread"
    return replace(run, mode=mode), why


def _progress_bar(total: int | None, name: str, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=name, unit="step", file=sys.stderr, dynamic_ncols=True)


def train_run(config: TrainConfig, run: RunConfig, data: Data, out: Path) -> dict[str, Any]:
    """Trains ``run`` on every rank; returns its summary (the same on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # Runs share the process: the resident size before this one is what it found there.
    host_start = resident_bytes()
    timeout = timedelta(seconds=config.timeout_s)
    device = torch.device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    host = _host_ranks_and_cores()
    run, mode_why = _chosen_mode(run, config, host)
    shared_gpu = _shared_gpu(device, host[0])
    unbalanced_why = _shared_compute(run, config, shared_gpu, host)
    group = _group(run.backend, timeout)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # runs share the process: peaks per run
    # NCCL cannot put two ranks on one GPU: ranks sharing GPUs all-reduce dense gradients on Gloo.
    dense_group = _group("gloo", timeout) if shared_gpu else group
    model_config = SASRecConfig(
        num_items=data.num_items,
        embedding_dim=config.embedding_dim,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        max_length=data.max_history,
    )
    torch.manual_seed(config.seed)
    embeddings = ShardedEmbeddingCollection(
        item_tables(model_config),
        group=group,
        optimizer=RowWiseAdagrad(lr=config.embedding_lr),
        mode=run.mode,
        seed=config.seed,
        timeout=timeout,
        device=device,
    )
    model = SASRec(model_config, embeddings).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    balancer = None
    if unbalanced_why is None:
        # The balancer moves CPU tensors on a background thread: Gloo, whatever the backend
        # (freescale's CPU path bought nothing there and its engine threads took the GIL from
        # the training thread).
        balancer_group = _group("gloo", timeout)
        balancer = Balancer(
            BalancerConfig(
                policy=run.policy,  # type: ignore[arg-type]
                length_feature="history",
                # The FLOP model until enough steps are measured, then a fit to the ranks'
                # measured compute (the FLOP model is off by tens of % on real hardware).
                cost_model=cost_model(model_config, config.num_negatives),
                fit=CostFitConfig() if config.fit_cost_model else None,
                timeout=timeout,
                min_gain=config.min_balance_gain,
            ),
            group=balancer_group,
        )
    pipeline = TrainPipeline(
        model,
        optimizer,
        balancer=balancer,
        group=dense_group,
        device=device,
        # The job reads losses from the reports only: no per-sample outputs travel back.
        config=PipelineConfig(weights=target_counts, return_outputs=False, timeout=timeout),
    )
    saved = None if config.checkpoint_dir is None else Path(config.checkpoint_dir) / run.name
    start = 0
    if saved is not None and (saved / ".metadata").exists():
        start = int(checkpoint.load(saved, pipeline)["step"])
    folder = out / run.name
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    reports = _train(pipeline, data.batches(rank, world, start), folder, run, config, start)
    if saved is not None:
        checkpoint.save(saved, pipeline)
    quality = _evaluate(model, embeddings, data, device)
    quality["digest"] = _digest(model, embeddings)
    balancing = _balancing(balancer, unbalanced_why)
    pipeline.close()
    embeddings.close()
    if balancer is not None:
        balancer.close()
        dist.destroy_process_group(balancer.group)
    if dense_group is not group:
        dist.destroy_process_group(dense_group)
    dist.destroy_process_group(group)
    summary = summarize(run, config, reports, quality)
    summary["balancing"] = balancing
    summary["mode_auto"] = mode_why
    summary["host_start_mb"] = host_start / 1e6
    if rank == 0:
        (folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _shared_gpu(device: torch.device, local_ranks: int) -> bool:
    """Whether ranks share GPUs: some host has fewer GPUs than ranks (collective on CUDA, so
    that every rank agrees)."""
    if device.type != "cuda":
        return False
    return _on_any_rank(torch.cuda.device_count() < local_ranks)


def _on_any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on some rank (collective)."""
    anywhere = torch.tensor([flag], dtype=torch.int32)
    dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
    return bool(anywhere.item())


def _shared_compute(
    run: RunConfig, config: TrainConfig, shared_gpu: bool, host: tuple[int, int]
) -> str | None:
    """Why ``run`` trains unbalanced although it names a policy, or None where it balances
    (whether it does is the same on every rank: collective for a run that names a policy on
    CPU; the reason is this host's). Ranks that share their compute share its time: moving
    samples from one to another changes no rank's step (the faster one's time goes to the
    other's work) and costs the shuffle. ``host``: this host's ranks and cores."""
    if run.policy == "none":
        return None
    if shared_gpu:
        return "ranks share a GPU"
    if config.device != "cpu":
        return None
    local_ranks, cores = host
    why = shared_cores(cores, local_ranks, config.threads)
    if _on_any_rank(why is not None) and why is None:
        why = "some host's ranks share its cores"
    return why


def _balancing(balancer: Balancer | None, unbalanced_why: str | None) -> dict[str, Any]:
    """Whether the run balanced, and with which cost model at its end (the same on every rank)."""
    if balancer is None:
        return {"balanced": False, "skipped": unbalanced_why}
    model = balancer.cost_model
    return {
        "balanced": True,
        "cost_model": [model.quadratic, model.linear, model.constant],
        "cost_model_fitted": balancer.cost_fit is not None and balancer.cost_fit.fitted,
        # With a fit to measured times, two runs may place samples differently.
        "partition_digest": balancer.partition_digest,
    }


def _train(
    pipeline: TrainPipeline,
    batches: Iterator[JaggedBatch],
    folder: Path,
    run: RunConfig,
    config: TrainConfig,
    start: int,
) -> list[StepReport]:
    rank = dist.get_rank()
    # A resumed run continues its record; a new one starts it afresh.
    lines = (folder / "steps.jsonl").open("a" if start else "w") if rank == 0 else None
    total = None if config.steps is None else config.steps - start
    bar = _progress_bar(total, run.name, rank == 0)
    reports: list[StepReport] = []
    try:
        while True:
            try:
                out = pipeline.progress(batches)
            except StopIteration:
                break
            for report in out.reports:
                reports.append(report)
                if lines is not None:
                    lines.write(json.dumps({"run": run.name, **report.as_dict()}) + "\n")
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{out.loss:.3f}")
    finally:
        if bar is not None:
            bar.close()
        if lines is not None:
            lines.close()
    return reports


def _digest(model: SASRec, embeddings: ShardedEmbeddingCollection) -> str:
    """A hash of every weight and optimizer state (collective): equal digests, equal bits."""
    hasher = hashlib.sha256()
    tables = embeddings.state_dict(full=True)
    dense = {k: v for k, v in model.state_dict().items() if not k.startswith("embeddings.")}
    for key, tensor in sorted({**tables, **dense}.items()):
        hasher.update(key.encode())
        hasher.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return hasher.hexdigest()[:16]


@torch.no_grad()
def _evaluate(
    model: SASRec, embeddings: ShardedEmbeddingCollection, data: Data, device: torch.device
) -> dict[str, float]:
    """HR@10 and NDCG@10 of the model and of a popularity ranker on the same candidates."""
    rank, world = dist.get_rank(), dist.get_world_size()
    items = embeddings.state_dict(full=True)[f"tables.{model.config.table_name}.weight"]
    counts = data.item_counts()
    sums = torch.zeros(5, dtype=torch.float64)
    for batch in data.eval_batches(rank, world, _EVAL_BATCH):
        on_device = batch_to_device(batch, device)
        scores = model.score(on_device, items).float().cpu()
        hits, ndcg = hit_rate_and_ndcg(scores, k=10)
        candidates = batch.features["candidates"].values.reshape(scores.shape)
        popular_hits, popular_ndcg = hit_rate_and_ndcg(popularity_scores(candidates, counts), k=10)
        sums += torch.tensor(
            [hits.sum(), ndcg.sum(), popular_hits.sum(), popular_ndcg.sum(), hits.numel()],
            dtype=torch.float64,
        )
    dist.all_reduce(sums)
    users = max(float(sums[4]), 1.0)
    return {
        "hr@10": float(sums[0]) / users,
        "ndcg@10": float(sums[1]) / users,
        "popularity_hr@10": float(sums[2]) / users,
        "popularity_ndcg@10": float(sums[3]) / users,
        "eval_users": float(sums[4]),
    }


def median(values: Sequence[float]) -> float:
    """The median, NaN for no values."""
    return statistics.median(values) if values else float("nan")


def p90(values: Sequence[float]) -> float:
    """The 90th percentile (nearest rank), NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def summarize(
    run: RunConfig, config: TrainConfig, reports: Sequence[StepReport], quality: dict[str, float]
) -> dict[str, Any]:
    """Medians over the run's steps (the first two, which pay for start-up, left out)."""
    timed = list(reports[2:]) or list(reports)
    steps = [r.step_s for r in timed]
    kinds = timed[0].exposed_s.keys() if timed else ()
    collisions = [r.collision_pct for r in timed if r.collision_pct is not None]
    losses = [r.loss for r in reports]
    return {
        "run": asdict(run),
        "config": asdict(config),
        "world_size": dist.get_world_size(),
        "steps": len(reports),
        "step_ms": 1e3 * median(steps),
        "step_p90_ms": 1e3 * p90(steps),
        "compute_ms": 1e3 * median([max(r.compute_s) for r in timed]),
        "mean_compute_ms": 1e3 * median([sum(r.compute_s) / len(r.compute_s) for r in timed]),
        "thread_cpu_ms": 1e3 * median([max(r.thread_cpu_s) for r in timed]),
        "straggler_pct": median([r.straggler_pct for r in timed]),
        "straggler_wait_ms": 1e3 * median([r.straggler_wait_s for r in timed]),
        "exposed_ms": {k: 1e3 * median([r.exposed_s[k] for r in timed]) for k in kinds},
        "samples_per_s": median([r.samples_per_s for r in timed]),
        "tokens_per_s": median([r.tokens_per_s for r in timed]),
        "collision_pct": median(collisions) if collisions else None,
        "embedding_mb_per_step": median([r.embedding_bytes for r in timed]) / 1e6,
        "prefetch_mb": max((r.prefetch_bytes for r in timed), default=0) / 1e6,
        "peak_host_mb": max((r.host_bytes for r in reports), default=0) / 1e6,
        "peak_device_mb": max((r.peak_device_bytes for r in reports), default=0) / 1e6,
        "final_loss": sum(losses[-_TAIL_STEPS:]) / max(len(losses[-_TAIL_STEPS:]), 1),
        "losses": losses,
        **quality,
        "finished_at": time.time(),
    }
