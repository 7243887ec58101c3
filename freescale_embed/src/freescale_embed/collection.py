"""``ShardedEmbeddingCollection``: row-wise sharded sequence embeddings, sync or prioritized.

The public module: it checks a call, hands the lookup to its strategy (``sync_lookup``: every
row in the step's own forward and backward; ``prioritized_lookup``: the next step's rows
prefetched in the background) and returns per-feature embeddings whose backward runs the
strategy's gradient sync. Both strategies produce the same bits.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from freescale_balance import JaggedBatch, JaggedTensor
from freescale_embed.channel import Channel
from freescale_embed.config import MODES, POOLINGS, Mode, Pooling, TableConfig, check_tables
from freescale_embed.inputs import as_batch, batch_problem
from freescale_embed.optim import SGD, Optimizer
from freescale_embed.prioritized_lookup import PrioritizedLookup
from freescale_embed.sharding import RowShard
from freescale_embed.step import StagedCall, Step, feature_outputs, pool
from freescale_embed.sync_lookup import SyncLookup
from freescale_embed.tables import TableShard, TableShards
from freescale_embed.telemetry import StepTelemetry

_TELEMETRY_STEPS = 10_000


class LookupStrategy(Protocol):
    """How a collection gets a step's rows and syncs its gradients (``SyncLookup``,
    ``PrioritizedLookup``)."""

    def check_usable(self) -> None:
        """Raises ``RuntimeError`` if an update of the tables was lost."""

    def is_announced(self, batch: JaggedBatch) -> bool:
        """``batch`` was checked as the previous step's next batch."""

    def call_problem(self, batch: JaggedBatch, staged: StagedCall) -> str | None:
        """What the mode asks of a call beyond its batch, or ``None``."""

    def lookup(self, batch: Any, staged: StagedCall, index: int, problem: str | None) -> Step:
        """The step's rows (``problem``: this rank's, flagged to every rank)."""

    def backward(
        self, step: Step, occurrence_gradients: list[torch.Tensor], optimizer: Optimizer
    ) -> None:
        """Syncs and applies ``step``'s gradients (or starts to)."""

    def synchronize(self, record: StepTelemetry | None) -> None:
        """Finishes every pending update."""

    def forget_prefetched(self) -> None:
        """Drops rows read from the tables before a load."""

    def close(self) -> None:
        """Frees threads and groups of its own."""


class _Lookup(torch.autograd.Function):
    """Per-feature embeddings of a step; its backward runs the step's gradient sync and update."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        dummy: torch.Tensor,
        owner: ShardedEmbeddingCollection,
        step: Step,
    ) -> tuple[torch.Tensor, ...]:
        ctx.owner, ctx.step = owner, step
        return tuple(feature_outputs(step, owner.shards))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, None, None]:
        ctx.owner._backward(ctx.step, grads)
        return None, None, None


class ShardedEmbeddingCollection(nn.Module):
    """Embedding tables sharded row-wise over a process group, trained by a fused optimizer.

    Every rank constructs the collection at the same point (prioritized mode creates a process
    group for its prefetch thread, with ``group``'s backend, and, when that backend moves no CPU
    tensors (NCCL), a Gloo group for each thread's host collectives: each collective over the
    default group), and every rank of ``group`` runs ``forward`` and a backward through its
    outputs for every training step.

    Tables, optimizer state and batches live on ``device``. On a CUDA device the embedding
    collectives are AllToAlls and AllGathers of CUDA tensors on ``group``'s backend (NCCL or
    ``freescale``); prioritized mode routes and plans with CPU tensors (IDs only) and its
    prefetch thread queues its device work on a side stream, ordered with the caller's current
    stream by events.

    Args:
        tables: the tables and the features that read them.
        group: process group whose ranks share the tables (default: the world).
        optimizer: ``SGD``, ``RowWiseAdagrad`` or ``Adam``; applied to the rows a step touched,
            in its backward (prioritized mode: partly in the background and at the next
            forward; ``synchronize`` finishes it).
        mode: ``"sync"``, or ``"prioritized"``: the next batch's rows are prefetched during the
            current step; the current step's backward sends the gradients of the rows both
            steps read, and the next forward applies them to the tables and the prefetched
            rows; the same bits as ``"sync"``.
        pooling: ``"none"`` (per-item sequence embeddings), ``"sum"`` or ``"mean"`` per sample.
        max_collision_rate: prioritized mode's guardrail: a step whose share of rows shared with
            the previous step is above this fraction is looked up synchronously instead
            (``None``: never).
        seed: seed of the initial rows (the same tables for every world size).
        dtype: dtype of rows and optimizer state.
        timeout: bound on waits for the prefetch thread and on its group's collectives.
        device: where tables, optimizer state and batches live (default: CPU).

    Example::

        tables = [TableConfig("items", 1_000_000, 64, ["history", "candidates"])]
        emb = ShardedEmbeddingCollection(tables, optimizer=RowWiseAdagrad(lr=0.05),
                                         mode="prioritized")
        for batch, next_batch in zip(batches, [*batches[1:], None]):
            out = emb(batch, next_batch, final=next_batch is None)
            loss = model(out["history"].values, out["history"].lengths, ...)
            loss.backward()                    # embedding rows update here
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        group: dist.ProcessGroup | None = None,
        optimizer: Optimizer | None = None,
        mode: Mode = "sync",
        *,
        pooling: Pooling = "none",
        max_collision_rate: float | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        timeout: timedelta = timedelta(seconds=120),
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        check_tables(tables)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        # What the user declared; ``shards``: this rank's block of each; ``tables``: those
        # blocks' rows and optimizer state (state-dict keys ``tables.<name>.*``).
        self.table_configs = tuple(tables)
        self.group = group if group is not None else dist.group.WORLD
        self.mode = mode
        self.pooling = pooling
        self.max_collision_rate = max_collision_rate
        self.optimizer: Optimizer = optimizer if optimizer is not None else SGD()
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.device = _with_index(torch.device(device))
        self.shards = [RowShard(t, self.world_size, self.rank) for t in tables]
        self.tables = TableShards(
            [
                TableShard(
                    shard,
                    self.optimizer,
                    shard.initial_weight(seed, index, dtype).to(self.device),
                )
                for index, shard in enumerate(self.shards)
            ]
        )
        self.register_buffer("step", torch.zeros((), dtype=torch.int64, device=self.device))
        # The buffer's value on the host: reading a CUDA buffer would wait for the GPU at the
        # start of every step.
        self._last_step = 0
        self.telemetry: deque[StepTelemetry] = deque(maxlen=_TELEMETRY_STEPS)
        self._channel = Channel(self.group, self.device)
        # A leaf that requires grad, so that the lookup joins the autograd graph.
        self._dummy = torch.zeros(0, requires_grad=True)
        # What a training pipeline staged for the next forward (``stage_next``).
        self._staged: StagedCall | None = None
        self._strategy: LookupStrategy
        if mode == "sync":
            self._strategy = SyncLookup(self.tables, self.shards, self._channel)
        else:
            self._strategy = PrioritizedLookup(
                self.tables,
                self.shards,
                self._channel,
                self.device,
                self.telemetry,
                max_collision_rate,
                timeout,
            )

    # -- public ----------------------------------------------------------------------------------

    def set_learning_rate(self, lr: float) -> None:
        """Uses ``lr`` from the next backward on (updates already under way keep theirs)."""
        self.optimizer = dataclasses.replace(self.optimizer, lr=lr)

    def stage_next(
        self,
        next_batch: JaggedBatch | Any | None,
        *,
        final: bool = False,
        checked: bool = False,
        next_on_host: JaggedBatch | None = None,
    ) -> None:
        """Gives the next ``forward`` its ``next_batch`` and ``final`` when its caller passes
        neither: a training pipeline knows the next batch, the model that calls the collection
        does not.

        Args:
            checked: the caller has checked the contents of ``next_batch`` and of the next
                forward's batch (well formed, every ID a row of its table), as
                ``TrainPipeline`` does on the host before moving them: the collection then
                checks only that their features are there, on its device (checking contents on
                a GPU reads it back several times per feature).
            next_on_host: ``next_batch`` on the host, unchanged until the step after the next
                forward: prioritized mode routes its IDs from there instead of copying them
                back from the device.
        """
        self._staged = StagedCall(next_batch, final, checked, next_on_host)

    def forward(
        self,
        batch: JaggedBatch | Any,
        next_batch: JaggedBatch | Any | None = None,
        *,
        final: bool = False,
    ) -> dict[str, JaggedTensor] | dict[str, torch.Tensor]:
        """Looks up every table feature of ``batch``.

        Args:
            batch: this rank's ``JaggedBatch`` (or TorchRec ``KeyedJaggedTensor``); features
                that no table reads are ignored.
            next_batch: prioritized mode: the batch this rank passes to the next call, whose
                rows are prefetched now. Required unless ``final``.
            final: prioritized mode: no next step follows (end of training or of an epoch);
                this step's backward syncs all of its gradients.

        Returns:
            Per feature, a ``JaggedTensor`` of ``[items, dim]`` embeddings with the batch's
            lengths; with pooling, a ``[batch, dim]`` tensor per feature.

        Raises:
            EmbeddingInputError: on every rank, before any ID of the invalid input moves, if
                some rank's input is invalid (IDs out of range, values/lengths mismatch, missing
                feature, missing or inconsistent next batch). In a synchronous lookup (sync
                mode, a prioritized run's first step) forward raises; in a prioritized step the
                check runs in the background, forward returns on every rank and the step's
                backward (or ``synchronize``) raises on every rank, after which the step is
                undone and the call can be made again. Outputs of such a step are not to be
                used.
        """
        self._strategy.check_usable()
        staged, self._staged = self._staged, None
        if staged is None or next_batch is not None or final:
            staged = StagedCall(next_batch, final)
        self._channel.meter.take()
        problem = self._input_problem(batch, staged)
        index = self._last_step + 1
        step = self._strategy.lookup(batch, staged, index, problem)
        batch = step.announced if step.announced is not None else as_batch(batch)
        step.record.add_exposed(self._channel.meter.take())
        self.telemetry.append(step.record)
        outputs = _Lookup.apply(self._dummy, self, step)
        names = [name for shard in self.shards for name in shard.table.feature_names]
        result = {}
        for name, values in zip(names, outputs, strict=True):
            lengths = batch.features[name].lengths
            pooled = self.pooling != "none"
            result[name] = (
                pool(values, lengths, self.pooling) if pooled else JaggedTensor(values, lengths)
            )
        return result

    def synchronize(self) -> None:
        """Applies every pending background update before returning.

        In prioritized mode this finishes the last backward's gradient sync, which runs
        collectives on the prefetch group: call it (and ``state_dict``, ``load_state_dict``,
        ``close``) on every rank.
        """
        self._strategy.check_usable()
        self._strategy.synchronize(self.telemetry[-1] if self.telemetry else None)

    def close(self) -> None:
        """Finishes background work, stops the prefetch thread and frees the process groups the
        collection made (also when finishing fails, which it raises)."""
        try:
            self.synchronize()
        finally:
            self._strategy.close()

    def state_dict(self, *args: Any, full: bool = False, **kwargs: Any) -> dict[str, Any]:
        """Tables, optimizer state and step count.

        Args:
            full: collective: gather every table whole on every rank (default: this rank's
                rows only, keys ``tables.<name>.weight``, ``tables.<name>.<state>``, ``step``).
        """
        self.synchronize()
        state = super().state_dict(*args, **kwargs)
        if full:
            prefix = kwargs.get("prefix", "")
            for name, table in self.tables.named_shards():
                for buffer in ("weight", *table.state_names):
                    key = f"{prefix}tables.{name}.{buffer}"
                    state[key] = self._gather_rows(table.shard, getattr(table, buffer))
        return state

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        # Here rather than in load_state_dict, so that loading a model that contains the
        # collection also waits for background updates and drops rows prefetched from the old
        # tables (the next forward looks its batch up afresh).
        self.synchronize()
        self._strategy.forget_prefetched()
        super()._load_from_state_dict(*args, **kwargs)
        self._last_step = int(self.step)

    # -- forward ---------------------------------------------------------------------------------

    def _input_problem(self, batch: Any, staged: StagedCall) -> str | None:
        try:
            jagged = as_batch(batch)
        except TypeError as error:
            return str(error)
        # A prioritized step's batch was checked as the previous step's next batch.
        checked = staged.checked or self._strategy.is_announced(jagged)
        problem = batch_problem(jagged, self.shards, self.device, checked=checked)
        if problem is not None:
            return problem
        return self._strategy.call_problem(jagged, staged)

    # -- backward --------------------------------------------------------------------------------

    def _backward(self, step: Step, grads: Sequence[torch.Tensor]) -> None:
        if step.done:
            raise RuntimeError(
                f"backward of embedding step {step.index} ran twice; each step updates once"
            )
        step.done = True
        self._channel.meter.take()
        dtype = next(iter(self.tables)).weight.dtype
        per_table, start = [], 0
        for shard in self.shards:
            count = len(shard.table.feature_names)
            parts = [g.to(dtype) for g in grads[start : start + count]]
            # A lone feature's gradient is used as it is: cat would copy it on the critical path.
            per_table.append(parts[0] if count == 1 else torch.cat(parts))
            start += count
        self._strategy.backward(step, per_table, self.optimizer)
        self.step.fill_(step.index)
        self._last_step = step.index
        step.record.add_exposed(self._channel.meter.take())

    # -- state -------------------------------------------------------------------------------------

    def _gather_rows(self, shard: RowShard, local: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(shard.block, *local.shape[1:], dtype=local.dtype, device=local.device)
        padded[: local.shape[0]] = local
        gathered = self._channel.all_gather(padded)
        return gathered.reshape(-1, *local.shape[1:])[: shard.table.num_embeddings].clone()


def _with_index(device: torch.device) -> torch.device:
    """``device`` with its index (``cuda`` means the current CUDA device), to compare devices."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
