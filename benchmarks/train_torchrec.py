"""SASRec trained by FreeScale's TrainPipeline and by TorchRec 1.8, side by side on the CPU.

Both sides train the same model (``freescale_embed.models.SASRec``: the same dense weights, the
same initial item rows) on the same synthetic batches, 2 ranks over Gloo, and each rank records
its per-step losses and the wall time of every ``progress`` call:

* FreeScale: ``TrainPipeline`` in sync mode, no balancer, over a ``ShardedEmbeddingCollection``
  (row-wise sharded) with a fused ``RowWiseAdagrad`` (or ``SGD``) table optimizer and dense
  Adam; the loss is the sum of per-sample losses over the global weight (``target_counts``), and
  DDP sums the dense gradients.
* TorchRec: ``DistributedModelParallel`` around a wrapper whose ``ec`` is a TorchRec
  ``EmbeddingCollection`` (the item table, read by ``history`` and ``negatives``, row-wise
  sharded, fused FBGEMM ``EXACT_ROWWISE_ADAGRAD`` / ``EXACT_SGD`` with the same learning rate and
  eps), trained by ``TrainPipelineSparseDist`` on ``device=cpu``. ``SASRec`` itself is built
  with ``TorchRecItems`` in place of the FreeScale collection: a module with the collection's
  call signature (``batch -> {feature: JaggedTensor}``) that hands over the lookup TorchRec's
  ``ec`` made of the batch's ``KeyedJaggedTensor``.

Gradient scaling on the TorchRec side: its DDP averages the dense gradients over ranks and its
row-wise output AllToAll divides the embedding gradients by the world size (TorchRec's default
``comm_ops`` gradient division, kept on), so each rank's loss is ``local sum * world / global
weight``: the averaged gradients are then FreeScale's summed ones. With a power-of-two world the
scaling by ``world`` and the division by it are exact: on the same weights the dense gradients
agree bitwise (after one step the dense weights are equal), and only the fused row updates
(their sums of a row's gradients over duplicate IDs, taken in another order by FBGEMM) differ
in rounding, which the later steps inherit.

Each side runs ``--rounds`` times, alternating which goes first (the same losses every round,
checked), so that on a shared machine changes of load spread over both sides; the step time of
a step is the slowest rank's ``progress``, the first ``--warmup`` steps of each run left out.
The data are generated before training (the same lists on both sides), so neither step time
includes making batches; TorchRec's iterator all-reduces each batch's weight (the global
weight, an integer), which FreeScale's input exchange does on its background thread.

Usage (from the project root; 2 local ranks, Gloo on loopback)::

    python benchmarks/train_torchrec.py --steps 60 --global-batch 32 --max-history 256 --dim 32

prints the median and p90 step time per side and the largest loss difference, and writes
``train_torchrec.json`` and ``train_torchrec.png`` under ``--out`` (default
``out/train_torchrec``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from freescale_balance import JaggedBatch, JaggedTensor
from freescale_embed import SGD, RowWiseAdagrad, ShardedEmbeddingCollection, TableConfig
from freescale_embed.data.synthetic import SyntheticConfig, synthetic_batches
from freescale_embed.models import SASRec, SASRecConfig, item_tables, target_counts
from freescale_embed.pipeline import PipelineConfig, TrainPipeline
from freescale_embed.train.job import median, p90

# The item table's name: TorchRec's EmbeddingCollection keeps its tables in an nn.ModuleDict,
# which refuses the name "items" (a ModuleDict method).
TABLE = "item"


@dataclass(frozen=True)
class CompareConfig:
    """One comparison: model, data and optimizers, the same on both sides.

    Attributes:
        steps: training steps (global batches).
        global_batch: samples per step over all ranks.
        max_history: longest history (and the model's ``max_length``).
        dim: embedding and transformer width.
        num_items: rows of the item table (more than ``max_history + 101``).
        num_users: users of the synthetic data set.
        num_negatives: sampled negatives per sample.
        num_layers: transformer blocks.
        num_heads: attention heads.
        optimizer: the table's fused optimizer, ``"adagrad"`` (row-wise) or ``"sgd"``.
        embedding_lr: its learning rate.
        eps: row-wise Adagrad's eps.
        lr: dense Adam's learning rate.
        seed: seed of the data, the dense weights and the initial rows.
        threads: torch intra-op threads per rank.
        warmup: leading steps of each run left out of the step-time statistics.
        rounds: runs of each side, alternating which goes first (the same losses every round;
            on a busy machine alternating spreads load changes over both sides' times).
    """

    steps: int = 6
    global_batch: int = 8
    max_history: int = 32
    dim: int = 16
    num_items: int = 2000
    num_users: int = 4096
    num_negatives: int = 32
    num_layers: int = 2
    num_heads: int = 2
    optimizer: str = "adagrad"
    embedding_lr: float = 0.05
    eps: float = 1e-8
    lr: float = 1e-3
    seed: int = 0
    threads: int = 1
    warmup: int = 2
    rounds: int = 1

    def model(self) -> SASRecConfig:
        return SASRecConfig(
            num_items=self.num_items,
            embedding_dim=self.dim,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            max_length=self.max_history,
            table_name=TABLE,
            attention="torch",
        )

    def data(self) -> SyntheticConfig:
        return SyntheticConfig(
            num_users=self.num_users,
            num_items=self.num_items,
            max_history=self.max_history,
            num_negatives=self.num_negatives,
            global_batch_size=self.global_batch,
            num_steps=self.steps,
            seed=self.seed,
        )

    def table_optimizer(self) -> SGD | RowWiseAdagrad:
        if self.optimizer == "sgd":
            return SGD(lr=self.embedding_lr)
        if self.optimizer == "adagrad":
            return RowWiseAdagrad(lr=self.embedding_lr, eps=self.eps)
        raise ValueError(f"optimizer must be 'adagrad' or 'sgd', got {self.optimizer!r}")


@dataclass
class SideRun:
    """One side's run on one rank.

    Attributes:
        losses: per step, the global loss (sum of every rank's per-sample losses over the
            global weight; float64 sum of the ranks' float32 local sums).
        local_sums: per step, this rank's float32 sum of per-sample losses.
        sample_losses: per step, this rank's per-sample losses.
        step_s: per step, the wall time of this rank's ``progress`` call.
        cpu_s: per step, the CPU time this rank's process spent in it (all its threads: the
            pipeline's background thread and Gloo's too); less swayed by other load than the
            wall time on a shared machine.
        dense: the dense parameters after training.
        dense_after_first: the dense parameters after the first step.
        table: the whole item table after training.
        pipelined: TorchRec's sharded modules that ``TrainPipelineSparseDist`` pipelined.
    """

    losses: list[float] = field(default_factory=list)
    local_sums: list[float] = field(default_factory=list)
    sample_losses: list[torch.Tensor] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    dense_after_first: dict[str, torch.Tensor] = field(default_factory=dict)
    table: torch.Tensor | None = None
    pipelined: list[str] = field(default_factory=list)


# -- TorchRec side: the adapter, the batch, the model ---------------------------------------------


@dataclass(frozen=True)
class LookedUpBatch(JaggedBatch):
    """A ``JaggedBatch`` that carries the embedding lookup TorchRec already made of it."""

    embedded: Mapping[str, Any] | None = None


class TorchRecItems(nn.Module):
    """Stands in for SASRec's ``ShardedEmbeddingCollection`` on the TorchRec side.

    Same call signature: ``items(batch) -> {feature: freescale_balance.JaggedTensor}`` (values
    ``[T, dim]``, lengths ``[B]``), and the same ``table_configs`` (SASRec checks the table).
    The lookup itself is TorchRec's: ``TrainPipelineSparseDist`` pipelines a sharded module
    only if it is called at the top of the model's forward on an attribute of the input (its
    ``input_dist`` of the next batch runs during this step), so ``TorchRecSASRec.forward`` calls
    the ``EmbeddingCollection`` on the batch's ``KeyedJaggedTensor`` and this module converts
    the result. It holds no TorchRec module, so that SASRec stays a leaf for TorchRec's FX
    tracing (SASRec's forward branches on data and cannot be traced).
    """

    def __init__(self, tables: Sequence[TableConfig]) -> None:
        super().__init__()
        self.table_configs = tuple(tables)

    def forward(self, batch: JaggedBatch) -> dict[str, JaggedTensor]:
        embedded = getattr(batch, "embedded", None)
        if embedded is None:
            raise ValueError("TorchRecItems needs a LookedUpBatch (TorchRec's lookup of it)")
        if hasattr(embedded, "wait"):
            embedded = embedded.wait()
        return {
            name: JaggedTensor(embedded[name].values(), embedded[name].lengths())
            for name in batch.features
        }


@dataclass
class TorchRecBatch(Pipelineable):
    """The TorchRec pipeline's input: the batch's features as a ``KeyedJaggedTensor`` (what the
    sharded ``EmbeddingCollection`` reads), the batch itself (what SASRec reads) and the step's
    global weight."""

    sparse: KeyedJaggedTensor
    jagged: JaggedBatch
    global_weight: int

    def to(self, device: torch.device, non_blocking: bool = False) -> TorchRecBatch:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, non_blocking=non_blocking)

        jagged = JaggedBatch(
            features={
                n: JaggedTensor(move(f.values), move(f.lengths))
                for n, f in self.jagged.features.items()
            },
            dense={n: move(t) for n, t in self.jagged.dense.items()},
        )
        return TorchRecBatch(
            self.sparse.to(device=device, non_blocking=non_blocking), jagged, self.global_weight
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.sparse.record_stream(stream)
        for f in self.jagged.features.values():
            f.values.record_stream(stream)
            f.lengths.record_stream(stream)
        for t in self.jagged.dense.values():
            t.record_stream(stream)

    def pin_memory(self) -> TorchRecBatch:
        jagged = JaggedBatch(
            features={
                n: JaggedTensor(f.values.pin_memory(), f.lengths.pin_memory())
                for n, f in self.jagged.features.items()
            },
            dense={n: t.pin_memory() for n, t in self.jagged.dense.items()},
        )
        return TorchRecBatch(self.sparse.pin_memory(), jagged, self.global_weight)


class _Head(nn.Module):
    """SASRec on TorchRec's lookup; the loss TorchRec's averaging turns into FreeScale's."""

    def __init__(self, sasrec: SASRec, world_size: int) -> None:
        super().__init__()
        self.sasrec = sasrec
        self.world_size = world_size

    def forward(self, batch: TorchRecBatch, embedded: Any) -> tuple[torch.Tensor, torch.Tensor]:
        jagged = batch.jagged
        losses = self.sasrec(LookedUpBatch(jagged.features, jagged.dense, embedded))
        # DDP averages dense gradients and the output AllToAll divides embedding gradients by
        # the world size: scaled by it, they are the sums FreeScale takes.
        loss = losses.sum() * self.world_size / max(batch.global_weight, 1)
        return loss.reshape(1), losses.detach()


class TorchRecSASRec(nn.Module):
    """The model DistributedModelParallel shards: the lookup at the top, SASRec after it."""

    def __init__(self, ec: nn.Module, sasrec: SASRec, world_size: int) -> None:
        super().__init__()
        self.ec = ec
        self.head = _Head(sasrec, world_size)

    def forward(self, batch: TorchRecBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(batch, self.ec(batch.sparse))


def _fused_params(optimizer: SGD | RowWiseAdagrad) -> dict[str, Any]:
    """FBGEMM's fused optimizer of the same update (freescale_embed.optim follows FBGEMM)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    if isinstance(optimizer, SGD):
        return {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": optimizer.lr}
    return {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": optimizer.lr,
        "eps": optimizer.eps,
    }


def row_wise_collection(
    tables: Sequence[TableConfig], optimizer: SGD | RowWiseAdagrad
) -> tuple[Any, Any, Any]:
    """A TorchRec ``EmbeddingCollection`` of ``tables`` on the meta device, row-wise sharded.

    Returns the collection, its sharder (FBGEMM's fused ``optimizer``) and its module sharding
    plan over all ranks of the default group, for ``DistributedModelParallel`` to apply.
    """
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    world = dist.get_world_size()
    ec = EmbeddingCollection(
        tables=[
            EmbeddingConfig(
                name=t.name,
                embedding_dim=t.embedding_dim,
                num_embeddings=t.num_embeddings,
                feature_names=list(t.feature_names),
            )
            for t in tables
        ],
        device=torch.device("meta"),
    )
    sharder = EmbeddingCollectionSharder(fused_params=_fused_params(optimizer))
    plan = construct_module_sharding_plan(
        ec,
        # The fused CPU kernel: TorchRec 1.8's default dense CPU kernel returns too few rows
        # for sequence lookups (see tests/embed/torchrec_ranks.py).
        per_param_sharding={t.name: row_wise(compute_kernel="fused") for t in tables},
        local_size=world,
        world_size=world,
        device_type="cpu",
        sharder=sharder,
    )
    return ec, sharder, plan


def build_torchrec(
    config: CompareConfig, dense_init: Mapping[str, torch.Tensor], table_init: torch.Tensor
) -> tuple[Any, torch.optim.Optimizer, bool]:
    """DMP over ``TorchRecSASRec`` with the given initial dense weights and item rows.

    Returns the DMP model, its dense Adam, and whether ``torch.manual_seed`` alone already gave
    the same dense weights as FreeScale's build (they are loaded from ``dense_init`` either way).
    """
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    world = dist.get_world_size()
    model_config = config.model()
    tables = item_tables(model_config)
    torch.manual_seed(config.seed)
    sasrec = SASRec(model_config, TorchRecItems(tables))  # type: ignore[arg-type]
    seeded_same = all(
        torch.equal(p.detach(), dense_init[name]) for name, p in sasrec.named_parameters()
    )
    sasrec.load_state_dict(dict(dense_init), strict=True)
    ec, sharder, plan = row_wise_collection(tables, config.table_optimizer())
    model = DistributedModelParallel(
        TorchRecSASRec(ec, sasrec, world),
        device=torch.device("cpu"),
        plan=ShardingPlan({"ec": plan}),
        sharders=[sharder],  # type: ignore[list-item]
    )
    with torch.no_grad():
        for start, rows in _local_shards(model).values():
            rows.copy_(table_init[start : start + rows.shape[0]])
    dense = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    return model, torch.optim.Adam(dense, lr=config.lr), seeded_same


def _local_shards(model: nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    """Table name -> (first row, local rows) of this rank's TorchRec shard (a live view)."""
    shards = {}
    for key, value in model.state_dict().items():
        if not hasattr(value, "local_shards"):
            continue  # a dense parameter
        (shard,) = value.local_shards()
        shards[key.split(".")[-2]] = (shard.metadata.shard_offsets[0], shard.tensor)
    return shards


def _gather_table(model: nn.Module, num_items: int, dim: int) -> torch.Tensor:
    start, rows = _local_shards(model)[TABLE]
    pieces: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, (start, rows.detach().clone()))
    table = torch.zeros(num_items, dim)
    for begin, piece in pieces:
        table[begin : begin + piece.shape[0]] = piece
    return table


def _torchrec_batches(batches: Sequence[JaggedBatch]) -> Iterator[TorchRecBatch]:
    for batch in batches:
        weight = target_counts(batch).sum().reshape(1)
        dist.all_reduce(weight)
        yield TorchRecBatch(batch.to_keyed_jagged_tensor(), batch, int(weight))


# -- the two runs ---------------------------------------------------------------------------------


def _global_losses(run: SideRun, global_weights: Sequence[int]) -> list[float]:
    """FreeScale's step loss from every rank's local sums (float64 sum in rank order)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, run.local_sums)
    return [
        sum(sums[step] for sums in gathered) / max(weight, 1)
        for step, weight in enumerate(global_weights)
    ]


def _dense(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _freescale_model(
    config: CompareConfig,
) -> tuple[SASRec, ShardedEmbeddingCollection, dict[str, torch.Tensor], torch.Tensor]:
    """FreeScale's SASRec, seeded as ``freescale train`` builds it, and its initial dense
    weights and whole item table (collective)."""
    model_config = config.model()
    torch.manual_seed(config.seed)  # as freescale_embed.train.job does
    embeddings = ShardedEmbeddingCollection(
        item_tables(model_config),
        optimizer=config.table_optimizer(),
        mode="sync",
        seed=config.seed,
    )
    model = SASRec(model_config, embeddings)
    dense_init = {name: p.detach().clone() for name, p in model.named_parameters()}
    table_init = embeddings.state_dict(full=True)[f"tables.{TABLE}.weight"].clone()
    return model, embeddings, dense_init, table_init


def initial_state(config: CompareConfig) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The dense weights and item rows both sides start from: FreeScale's (collective)."""
    _, embeddings, dense_init, table_init = _freescale_model(config)
    embeddings.close()
    return dense_init, table_init


def train_freescale(
    config: CompareConfig, batches: Sequence[JaggedBatch]
) -> tuple[SideRun, dict[str, torch.Tensor], torch.Tensor]:
    """FreeScale's run; also returns the initial dense weights and item rows it started from."""
    model, embeddings, dense_init, table_init = _freescale_model(config)
    pipeline = TrainPipeline(
        model,
        torch.optim.Adam(model.parameters(), lr=config.lr),
        config=PipelineConfig(weights=target_counts),
    )
    run = SideRun()
    iterator = iter(batches)
    while True:
        started, cpu = time.perf_counter(), time.process_time()
        try:
            out = pipeline.progress(iterator)
        except StopIteration:
            break
        # Timed until the per-sample losses are in hand, as TorchRec's progress returns them.
        losses = out.outputs["loss"]
        run.step_s.append(time.perf_counter() - started)
        run.cpu_s.append(time.process_time() - cpu)
        if not run.dense_after_first:
            run.dense_after_first = _dense(model)
        run.losses.append(out.loss)
        run.sample_losses.append(losses)
        run.local_sums.append(float(losses.sum()))
    pipeline.close()
    run.dense = _dense(model)
    run.table = embeddings.state_dict(full=True)[f"tables.{TABLE}.weight"].clone()
    embeddings.close()
    return run, dense_init, table_init


def train_torchrec(
    config: CompareConfig,
    batches: Sequence[JaggedBatch],
    dense_init: Mapping[str, torch.Tensor],
    table_init: torch.Tensor,
) -> tuple[SideRun, bool]:
    """TorchRec's run from the same start; also whether the seeded build matched by itself."""
    from torchrec.distributed import comm_ops
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.distributed.types import ShardedModule

    comm_ops.set_gradient_division(True)  # TorchRec's default, which the loss scaling expects
    model, optimizer, seeded_same = build_torchrec(config, dense_init, table_init)
    pipeline = TrainPipelineSparseDist(model, optimizer, device=torch.device("cpu"))
    run = SideRun()
    iterator = _torchrec_batches(batches)
    while True:
        started, cpu = time.perf_counter(), time.process_time()
        try:
            losses = pipeline.progress(iterator)
        except StopIteration:
            break
        run.step_s.append(time.perf_counter() - started)
        run.cpu_s.append(time.process_time() - cpu)
        if not run.dense_after_first:
            run.dense_after_first = _dense(model.module.head.sasrec)
        run.sample_losses.append(losses)
        run.local_sums.append(float(losses.sum()))
    inner = model.module  # under DMP and DDP
    sharded = [n for n, m in inner.named_modules() if isinstance(m, ShardedModule)]
    run.pipelined = [name for name in sharded if inner.get_submodule(name).is_pipelined]
    if run.pipelined != sharded:
        raise RuntimeError(f"TrainPipelineSparseDist pipelined {run.pipelined} of {sharded}")
    run.dense = _dense(inner.head.sasrec)
    run.table = _gather_table(model, config.num_items, config.dim)
    return run, seeded_same


def _dense_diffs(
    ours: Mapping[str, torch.Tensor],
    theirs: Mapping[str, torch.Tensor],
    dim: int,
    but_key_bias: bool,
) -> list[float]:
    """Largest difference per dense parameter; ``but_key_bias``: without the attention's key
    bias (``qkv.bias[dim:2 dim]``). Softmax ignores a constant added to a query's logits, so
    that bias's gradient is zero up to rounding noise, which Adam's normalised step turns into
    moves of order ``lr`` in either direction: it drifts apart without changing any loss."""
    diffs = []
    for name, value in ours.items():
        diff = (value - theirs[name]).abs()
        if but_key_bias and name.endswith("qkv.bias"):
            diff = torch.cat([diff[:dim], diff[2 * dim :]])
        diffs.append(float(diff.max()))
    return diffs


def compare_rank(config: CompareConfig) -> dict[str, Any]:
    """Both runs on this rank (collective: every rank of the default Gloo group calls it)."""
    torch.set_num_threads(config.threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = list(synthetic_batches(config.data(), rank, world))
    weights = torch.tensor([int(target_counts(b).sum()) for b in batches])
    dist.all_reduce(weights)
    global_weights = [int(w) for w in weights]
    dense_init, table_init = initial_state(config)
    runs: dict[str, list[SideRun]] = {"freescale": [], "torchrec": []}
    seeded_same, same_start = True, True
    for round_ in range(config.rounds):
        for side in ("freescale", "torchrec")[:: 1 if round_ % 2 == 0 else -1]:
            if side == "freescale":
                run, dense, table = train_freescale(config, batches)
                same_start &= torch.equal(table, table_init) and all(
                    torch.equal(value, dense_init[name]) for name, value in dense.items()
                )
            else:
                run, seeded = train_torchrec(config, batches, dense_init, table_init)
                seeded_same &= seeded
            runs[side].append(run)
    ours, theirs = runs["freescale"][0], runs["torchrec"][0]
    for run in runs["torchrec"]:
        run.losses = _global_losses(run, global_weights)
    ours_from_sums = _global_losses(ours, global_weights)
    repeatable = all(
        run.losses == runs[side][0].losses
        and all(
            torch.equal(a, b)
            for a, b in zip(run.sample_losses, runs[side][0].sample_losses, strict=True)
        )
        for side in runs
        for run in runs[side]
    )
    assert theirs.table is not None and ours.table is not None
    pairs = list(zip(ours.sample_losses, theirs.sample_losses, strict=True))
    return {
        "rank": rank,
        "samples": [b.batch_size for b in batches],
        "global_weights": global_weights,
        "seeded_dense_same": seeded_same,
        "same_start_every_round": same_start,
        "repeatable": repeatable,
        "freescale": {
            "losses": ours.losses,
            "losses_from_local_sums": ours_from_sums,
            "step_s": [run.step_s for run in runs["freescale"]],
            "cpu_s": [run.cpu_s for run in runs["freescale"]],
        },
        "torchrec": {
            "losses": theirs.losses,
            "step_s": [run.step_s for run in runs["torchrec"]],
            "cpu_s": [run.cpu_s for run in runs["torchrec"]],
        },
        "sample_losses": {"freescale": ours.sample_losses, "torchrec": theirs.sample_losses},
        "max_sample_loss_diff": max((float((a - b).abs().max()) for a, b in pairs), default=0.0),
        "max_sample_loss_rel_diff": max(
            (float(((a - b).abs() / b.abs().clamp_min(1e-30)).max()) for a, b in pairs),
            default=0.0,
        ),
        "max_dense_diff": max(_dense_diffs(ours.dense, theirs.dense, config.dim, False)),
        "max_dense_diff_but_key_bias": max(
            _dense_diffs(ours.dense, theirs.dense, config.dim, True)
        ),
        "pipelined": theirs.pipelined,
        "dense_equal_after_first_step": all(
            torch.equal(value, theirs.dense_after_first[name])
            for name, value in ours.dense_after_first.items()
        ),
        "max_table_diff": float((ours.table - theirs.table).abs().max()),
        "max_table_change": float((ours.table - table_init).abs().max()),
        "first_step_losses_equal": bool(
            ours.sample_losses and torch.equal(ours.sample_losses[0], theirs.sample_losses[0])
        ),
    }


# -- the benchmark: two local ranks, the report ---------------------------------------------------


def _rank_main(rank: int, port: int, queue: Any, config: CompareConfig, world: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(config.threads))
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300)
        )
        result = compare_rank(config)
        # Plain lists: a tensor would travel as a shared-memory handle of this exiting process.
        result["sample_losses"] = {
            side: [t.tolist() for t in tensors] for side, tensors in result["sample_losses"].items()
        }
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def _per_step(
    results: Sequence[Mapping[str, Any]], side: str, key: str, round_: int, over_ranks: Any
) -> list[float]:
    times = (r[side][key][round_] for r in results)
    return [over_ranks(step) for step in zip(*times, strict=True)]


def combine(config: CompareConfig, results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The report of every rank's results: step times (slowest rank per step), loss gaps."""
    sides: dict[str, Any] = {}
    for side in ("freescale", "torchrec"):
        # Per round, per step: the slowest rank's wall time, the ranks' mean CPU time.
        rounds = [_per_step(results, side, "step_s", r, max) for r in range(config.rounds)]
        cpu_rounds = [
            _per_step(results, side, "cpu_s", r, statistics.fmean) for r in range(config.rounds)
        ]
        timed = [s for steps in rounds for s in (steps[config.warmup :] or steps)]
        cpu = [s for steps in cpu_rounds for s in (steps[config.warmup :] or steps)]
        sides[side] = {
            "step_ms": [1e3 * s for s in rounds[0]],
            "step_ms_per_round": [[1e3 * s for s in steps] for steps in rounds],
            "median_step_ms_per_round": [
                1e3 * median(steps[config.warmup :] or steps) for steps in rounds
            ],
            "median_step_ms": 1e3 * median(timed),
            "p90_step_ms": 1e3 * p90(timed),
            "timed_steps": len(timed),
            "median_cpu_ms": 1e3 * median(cpu),
            "p90_cpu_ms": 1e3 * p90(cpu),
            "losses": list(results[0][side]["losses"]),
        }
    ours, theirs = sides["freescale"]["losses"], sides["torchrec"]["losses"]
    diffs = [abs(a - b) for a, b in zip(ours, theirs, strict=True)]
    return {
        "config": asdict(config),
        "world_size": len(results),
        "sides": sides,
        "loss_abs_diff": diffs,
        "max_loss_abs_diff": max(diffs, default=0.0),
        "max_loss_rel_diff": max(
            (d / max(abs(b), 1e-30) for d, b in zip(diffs, theirs, strict=True)), default=0.0
        ),
        "max_sample_loss_diff": max(r["max_sample_loss_diff"] for r in results),
        "max_sample_loss_rel_diff": max(r["max_sample_loss_rel_diff"] for r in results),
        "max_dense_diff": max(r["max_dense_diff"] for r in results),
        "max_dense_diff_but_key_bias": max(r["max_dense_diff_but_key_bias"] for r in results),
        "pipelined": results[0]["pipelined"],
        "dense_equal_after_first_step": all(r["dense_equal_after_first_step"] for r in results),
        "max_table_diff": max(r["max_table_diff"] for r in results),
        "max_table_change": max(r["max_table_change"] for r in results),
        "first_step_losses_equal": all(r["first_step_losses_equal"] for r in results),
        "seeded_dense_same": all(r["seeded_dense_same"] for r in results),
        "same_start_every_round": all(r["same_start_every_round"] for r in results),
        "repeatable": all(r["repeatable"] for r in results),
        "freescale_loss_check": max(
            abs(a - b)
            for r in results
            for a, b in zip(
                r["freescale"]["losses"], r["freescale"]["losses_from_local_sums"], strict=True
            )
        ),
        "samples_per_step": [sum(s) for s in zip(*(r["samples"] for r in results), strict=True)],
        "global_weights": list(results[0]["global_weights"]),
    }


def _environment() -> dict[str, Any]:
    import torchrec

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "commit": commit,
        "torch": torch.__version__,
        "torchrec": getattr(torchrec, "__version__", "?"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg(),
    }


def plot(report: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = report["sides"]
    steps = range(1, len(sides["freescale"]["losses"]) + 1)
    figure, (losses, gaps, times) = plt.subplots(1, 3, figsize=(15, 4.2))
    for (side, values), (style, color) in zip(
        sides.items(), (("-", "tab:blue"), ("--", "tab:orange")), strict=True
    ):
        losses.plot(steps, values["losses"], style, color=color, label=side)
        for round_, round_ms in enumerate(values["step_ms_per_round"]):
            label = None
            if round_ == 0:
                label = (
                    f"{side}: median {values['median_step_ms']:.1f} ms, "
                    f"p90 {values['p90_step_ms']:.1f} ms (steps > {report['config']['warmup']})"
                )
            times.plot(steps, round_ms, style, color=color, alpha=0.6, linewidth=1, label=label)
    losses.set(xlabel="step", ylabel="loss (per target)", title="training loss")
    losses.legend()
    gap = [max(d, 1e-12) for d in report["loss_abs_diff"]]
    gaps.semilogy(steps, gap, "o-", markersize=3)
    gaps.set(
        xlabel="step", ylabel="|freescale - torchrec|", title="loss difference (0 drawn at 1e-12)"
    )
    rounds = report["config"]["rounds"]
    times.set(
        xlabel="step",
        ylabel="ms (slowest rank)",
        title=f"step time, {rounds} round(s) per side",
    )
    times.legend(fontsize=8)
    config = report["config"]
    figure.suptitle(
        f"SASRec, {report['world_size']} ranks on CPU (Gloo), global batch "
        f"{config['global_batch']}, max history {config['max_history']}, dim {config['dim']}, "
        f"{config['optimizer']}: FreeScale TrainPipeline vs TorchRec TrainPipelineSparseDist"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _table(report: Mapping[str, Any]) -> str:
    rows = [
        f"{'side':<10} {'median ms':>10} {'p90 ms':>10} {'CPU ms':>8} {'CPU p90':>8} "
        f"{'final loss':>11}  per-round median ms"
    ]
    for side, values in report["sides"].items():
        rounds = ", ".join(f"{m:.1f}" for m in values["median_step_ms_per_round"])
        rows.append(
            f"{side:<10} {values['median_step_ms']:>10.1f} {values['p90_step_ms']:>10.1f} "
            f"{values['median_cpu_ms']:>8.1f} {values['p90_cpu_ms']:>8.1f} "
            f"{values['losses'][-1]:>11.6f}  {rounds}"
        )
    rows.append(
        f"largest loss difference: {report['max_loss_abs_diff']:.3g} absolute, "
        f"{report['max_loss_rel_diff']:.3g} relative (per-sample: "
        f"{report['max_sample_loss_diff']:.3g} absolute, "
        f"{report['max_sample_loss_rel_diff']:.3g} relative); after training: tables "
        f"{report['max_table_diff']:.3g}, dense {report['max_dense_diff_but_key_bias']:.3g} "
        f"(attention key bias, which no loss sees: {report['max_dense_diff']:.3g})"
    )
    load = report["environment"]
    rows.append(f"load average before {load['load_before']}, after {load['load_after']}")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    defaults = CompareConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--max-history", type=int, default=256)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--num-items", type=int, default=20_000)
    parser.add_argument("--num-users", type=int, default=defaults.num_users)
    parser.add_argument("--num-negatives", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=defaults.num_layers)
    parser.add_argument("--num-heads", type=int, default=defaults.num_heads)
    parser.add_argument("--optimizer", choices=("adagrad", "sgd"), default=defaults.optimizer)
    parser.add_argument("--embedding-lr", type=float, default=defaults.embedding_lr)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=1200.0)
    parser.add_argument("--out", type=Path, default=Path("out/train_torchrec"))
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error("--world-size must be at least 2")
    config = CompareConfig(
        steps=args.steps,
        global_batch=args.global_batch,
        max_history=args.max_history,
        dim=args.dim,
        num_items=args.num_items,
        num_users=args.num_users,
        num_negatives=args.num_negatives,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        optimizer=args.optimizer,
        embedding_lr=args.embedding_lr,
        lr=args.lr,
        seed=args.seed,
        threads=args.threads,
        warmup=args.warmup,
        rounds=args.rounds,
    )
    from freescale_embed.bench import launch_ranks

    environment = _environment()
    started = time.perf_counter()
    replies = launch_ranks(
        _rank_main, args.world_size, (config, args.world_size), args.timeout_s, stop_on_error=True
    )
    for rank, (kind, payload) in sorted(replies.items()):
        if kind != "ok":
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
    missing = sorted(set(range(args.world_size)) - set(replies))
    if missing:
        raise TimeoutError(f"ranks {missing} did not finish within {args.timeout_s:.0f} s")
    report = combine(config, [replies[rank][1] for rank in range(args.world_size)])
    environment["load_after"] = os.getloadavg()
    report["environment"] = environment
    report["wall_s"] = time.perf_counter() - started
    report["argv"] = list(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_torchrec.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.out / "train_torchrec.png")
    print(_table(report))
    print(f"wrote {args.out / 'train_torchrec.json'} and {args.out / 'train_torchrec.png'}")
    return report


if __name__ == "__main__":
    main()
