"""Per-rank functions of the training-pipeline tests (run on real local groups)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from freescale_balance import (
    AlphaAutoTuneConfig,
    Balancer,
    BalancerConfig,
    CostFitConfig,
    JaggedBatch,
    JaggedTensor,
)
from freescale_embed import (
    SGD,
    RowWiseAdagrad,
    ShardedEmbeddingCollection,
    TableConfig,
    checkpoint,
)
from freescale_embed.pipeline import PipelineConfig, PipelineError, TrainPipeline

ROWS = 97
DIM = 8


class TinyRecommender(nn.Module):
    """Per-item embeddings through a small MLP; a sample's loss sums its items' squared errors."""

    def __init__(self, mode: str, optimizer: str = "sgd") -> None:
        super().__init__()
        torch.manual_seed(0)
        table_optimizer = SGD(lr=0.5) if optimizer == "sgd" else RowWiseAdagrad(lr=0.5)
        self.embeddings = ShardedEmbeddingCollection(
            [TableConfig("items", ROWS, DIM, ["history"])], optimizer=table_optimizer, mode=mode
        )
        self.mlp = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, batch: JaggedBatch) -> dict[str, torch.Tensor]:
        history = self.embeddings(batch)["history"]
        lengths = history.lengths.to(torch.int64)
        per_item = self.mlp(history.values).squeeze(-1)
        target = batch.features["history"].values.to(torch.float32).remainder(7) / 7
        sample_of_item = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        errors = (per_item - target).pow(2)
        losses = torch.zeros(lengths.numel()).index_add(0, sample_of_item, errors)
        return {"loss": losses, "sample_id": batch.dense["sample_id"]}


def global_batch(seed: int, step: int, size: int, max_length: int = 24) -> JaggedBatch:
    """Global batch ``step`` of a deterministic stream (heavy-tailed lengths)."""
    generator = torch.Generator().manual_seed(seed * 100_003 + step)
    lengths = (torch.rand(size, generator=generator).pow(3) * max_length).to(torch.int64) + 1
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=generator)
    ids = torch.arange(step * size, (step + 1) * size, dtype=torch.int64)
    return JaggedBatch(
        features={"history": JaggedTensor(values, lengths)}, dense={"sample_id": ids}
    )


def local_batches(seed: int, steps: int, global_size: int, start: int = 0) -> Iterator[JaggedBatch]:
    """This rank's slice of global batches ``start .. steps - 1``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    share = global_size // world
    for step in range(start, steps):
        batch = global_batch(seed, step, global_size)
        yield batch.select(torch.arange(rank * share, (rank + 1) * share))


@dataclass
class Run:
    losses: list[float]
    local_losses: list[torch.Tensor]
    sample_ids: list[torch.Tensor]
    loaded_ids: list[torch.Tensor]
    dense: dict[str, torch.Tensor]
    tables: dict[str, torch.Tensor]
    samples: int
    reports: int
    cost_model: tuple[float, float, float, bool] | None = None  # the balancer's, at the end


def train(
    mode: str,
    policy: str | None,
    steps: int = 8,
    global_size: int = 16,
    seed: int = 1,
    rank_steps: dict[int, int] | None = None,
    optimizer: str = "sgd",
    save_to: str | None = None,
    load_from: str | None = None,
    fit: CostFitConfig | None = None,
) -> Run:
    """Trains ``TinyRecommender`` on global batches up to ``steps``; ``rank_steps`` gives some
    ranks fewer batches (uneven ends); ``load_from`` resumes from a checkpoint (at its step),
    ``save_to`` writes one at the end."""
    rank = dist.get_rank()
    model = TinyRecommender(mode, optimizer)
    dense_optimizer = torch.optim.Adam(model.mlp.parameters(), lr=0.01)
    # VBS tunes its exponent from measured step times, which differ between runs: frozen here
    # (the pipeline still gives the balancer the measured times), so that two runs balance alike.
    frozen = AlphaAutoTuneConfig(step_size=0.0)
    balancer = (
        None
        if policy is None
        else Balancer(BalancerConfig(policy=policy, autotune=frozen, fit=fit))
    )
    pipeline = TrainPipeline(model, dense_optimizer, balancer=balancer)
    start = 0 if load_from is None else int(checkpoint.load(load_from, pipeline)["step"])
    mine = (rank_steps or {}).get(rank, steps)
    loaded = list(local_batches(seed, mine, global_size, start))
    iterator = iter(loaded)
    losses, local_losses, sample_ids, reports = [], [], [], 0
    while True:
        try:
            out = pipeline.progress(iterator)
        except StopIteration:
            break
        losses.append(out.loss)
        local_losses.append(out.outputs["loss"])
        sample_ids.append(out.outputs["sample_id"])
        reports += len(out.reports)
    if save_to is not None:
        checkpoint.save(save_to, pipeline)
    tables = model.embeddings.state_dict(full=True)
    pipeline.close()
    model.embeddings.close()
    fitted = None
    if balancer is not None:
        model_ = balancer.cost_model
        fitted_ = balancer.cost_fit is not None and balancer.cost_fit.fitted
        fitted = (model_.quadratic, model_.linear, model_.constant, fitted_)
        balancer.close()
    return Run(
        losses=losses,
        local_losses=local_losses,
        sample_ids=sample_ids,
        loaded_ids=[b.dense["sample_id"] for b in loaded],
        dense={k: v.detach().clone() for k, v in model.mlp.state_dict().items()},
        tables={k: v for k, v in tables.items() if k.startswith("tables.")},
        samples=sum(len(r) for r in sample_ids),
        reports=reports,
        cost_model=fitted,
    )


class NoEmbeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)


def no_collection() -> str:
    try:
        TrainPipeline(NoEmbeddings(), torch.optim.SGD(NoEmbeddings().parameters(), lr=0.1))
    except ValueError as error:
        return str(error)
    return "no error"


class ScalarLoss(TinyRecommender):
    def forward(self, batch: JaggedBatch) -> torch.Tensor:  # type: ignore[override]
        return super().forward(batch)["loss"].mean()


class NaNAtStep(TinyRecommender):
    def __init__(self, mode: str, bad_rank: int, bad_step: int) -> None:
        super().__init__(mode)
        self.bad_rank, self.bad_step, self.calls = bad_rank, bad_step, 0

    def forward(self, batch: JaggedBatch) -> torch.Tensor:  # type: ignore[override]
        self.calls += 1
        losses = super().forward(batch)["loss"]
        if dist.get_rank() == self.bad_rank and self.calls == self.bad_step:
            losses = losses * float("nan")
        return losses


def _bad_batches(kind: str, bad_rank: int) -> list[JaggedBatch]:
    rank = dist.get_rank()
    batches = list(local_batches(3, 4, 8))
    if rank != bad_rank:
        return batches
    bad = batches[2]
    history = bad.features["history"]
    if kind == "id_out_of_range":
        values = history.values.clone()
        values[0] = ROWS + 5
        batches[2] = JaggedBatch({"history": JaggedTensor(values, history.lengths)}, bad.dense)
    elif kind == "schema_between_ranks":
        batches = [
            JaggedBatch(b.features, {"sample_id": b.dense["sample_id"].to(torch.int32)})
            for b in batches
        ]
    elif kind == "schema_between_steps":
        batches[2] = JaggedBatch(bad.features, {**bad.dense, "extra": torch.zeros(bad.batch_size)})
    elif kind == "lengths_mismatch":
        lengths = history.lengths.clone()
        lengths[0] += 1
        batches[2] = JaggedBatch({"history": JaggedTensor(history.values, lengths)}, bad.dense)
    return batches


def _sgd_pipeline(
    model: nn.Module, balancer: Balancer | None = None, config: PipelineConfig | None = None
) -> TrainPipeline:
    """A pipeline that trains ``model``'s MLP with plain SGD."""
    return TrainPipeline(
        model, torch.optim.SGD(model.mlp.parameters(), lr=0.1), balancer=balancer, config=config
    )


def refused(kind: str, mode: str, bad_rank: int = 1) -> str:
    """Trains until the pipeline refuses; returns the error every rank raised."""
    if kind == "not_per_sample":
        model: nn.Module = ScalarLoss(mode)
    elif kind == "nan":
        model = NaNAtStep(mode, bad_rank, bad_step=3)
    else:
        model = TinyRecommender(mode)
    pipeline = _sgd_pipeline(model)
    iterator = iter(_bad_batches(kind, bad_rank))
    message = "no error"
    try:
        while True:
            pipeline.progress(iterator)
    except StopIteration:
        pass
    except PipelineError as error:
        message = f"{pipeline.step}: {error}"
    pipeline.close()
    return message


def without_outputs() -> str:
    """A balanced run that keeps per-sample outputs where they were computed."""
    model = TinyRecommender("prioritized")
    balancer = Balancer(BalancerConfig(policy="fbs"))
    pipeline = _sgd_pipeline(model, balancer, PipelineConfig(return_outputs=False))
    iterator = iter(list(local_batches(5, 3, 8)))
    outputs = []
    while True:
        try:
            outputs.append(pipeline.progress(iterator))
        except StopIteration:
            break
    pipeline.close()
    model.embeddings.close()
    balancer.close()
    try:
        _ = outputs[0].outputs
    except PipelineError as error:
        return f"{len(outputs)} steps; {error}"
    return "outputs were returned"


def dies_mid_step(dead_rank: int, timeout_s: float) -> str:
    """Rank ``dead_rank`` exits at its fourth step; the others report what they raised."""
    bound = timedelta(seconds=timeout_s)
    model = TinyRecommender("prioritized")
    balancer = Balancer(BalancerConfig(policy="fbs", timeout=bound))
    pipeline = _sgd_pipeline(model, balancer, PipelineConfig(timeout=bound))
    iterator = iter(list(local_batches(7, 8, 8)))
    started = time.monotonic()
    try:
        for step in range(8):
            if dist.get_rank() == dead_rank and step == 3:
                os._exit(17)
            pipeline.progress(iterator)
    except Exception as error:  # whichever collective met the dead peer first
        return f"{type(error).__name__} after {time.monotonic() - started:.1f} s"
    return "no error"
