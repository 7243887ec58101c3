"""``ShardedEmbeddingCollection``: row-wise sharded sequence embeddings, sync or prioritized.

One training step on every rank, on the training thread::

    sync         forward:  [preflight statuses + ID counts] -> IDs -> lookup on owners -> rows
                 backward: per-ID gradients -> gradients to owners -> per-row sum -> optimizer
    prioritized  backward: collision rows' gradients to their owners and next-step requesters
                           (started, not waited for)
                 forward:  the previous backward's collision gradients arrive -> per-row sum
                           -> optimizer, on the owners and on the prefetched copies (every
                           other row was prefetched)

where ``[...]`` and each arrow that crosses ranks is one AllToAll, and the collision rows of
step t are those step t+1 reads too. The collision AllToAll moves while the caller does what
comes between a backward and the next forward (the dense optimizer step, the next batch);
``synchronize`` finishes it too. The prefetch thread does the rest (``prefetch``,
``collisions``), the preflight of a prioritized step included (``inputs``). Both modes produce
the same bits.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from freescale_balance import JaggedBatch, JaggedTensor
from freescale_embed._ops import segment_sum
from freescale_embed.channel import Channel, host_group
from freescale_embed.collisions import (
    CollisionUpdate,
    apply_collisions,
    send_collision_gradients,
)
from freescale_embed.config import MODES, POOLINGS, Mode, Pooling, TableConfig, check_tables
from freescale_embed.inputs import EmbeddingInputError, as_batch, batch_problem, same_ids
from freescale_embed.optim import SGD, Optimizer
from freescale_embed.prefetch import (
    DeferredGradients,
    Prepared,
    UpdateLost,
    finish_gradients,
    prepare_next,
)
from freescale_embed.routing import Routes, host_ids, route
from freescale_embed.sharding import RowShard
from freescale_embed.streams import stream_order, to_device
from freescale_embed.tables import TableShard, TableShards
from freescale_embed.telemetry import StepTelemetry
from freescale_embed.transfers import (
    apply_gradients,
    send_gradients,
    send_rows,
    unique_gradients,
)
from freescale_embed.worker import Worker

_TELEMETRY_STEPS = 10_000


@dataclasses.dataclass
class _Step:
    """One forward awaiting its backward."""

    index: int
    routes: Routes  # on the tables' device
    # prioritized: the same on the host (the next step's prefetch plans with it)
    host_routes: Routes | None
    values: list[torch.Tensor]
    record: StepTelemetry
    next_future: Any = None  # prioritized: the future of step t+1's ``Prepared`` (or ``None``)
    # prioritized: the prepared step and expected batch before this forward, and what its
    # telemetry held then (for ``_undo``)
    undo: tuple[Prepared | None, JaggedBatch | None, tuple[float, float, int, int]] | None = None
    # prioritized: the batch the step was routed for (announced at the previous step)
    batch: JaggedBatch | None = None
    done: bool = False


@dataclasses.dataclass(frozen=True)
class _Staged:
    """What the next forward gets for its next batch (``stage_next``, or its own arguments)."""

    batch: Any
    final: bool
    checked: bool = False
    on_host: JaggedBatch | None = None


class _Lookup(torch.autograd.Function):
    """Per-feature embeddings of a step; its backward runs the step's gradient sync and update."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        dummy: torch.Tensor,
        owner: ShardedEmbeddingCollection,
        step: _Step,
    ) -> tuple[torch.Tensor, ...]:
        ctx.owner, ctx.step = owner, step
        return tuple(owner._feature_outputs(step))

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
        # Groups the collection made itself, destroyed by ``close``.
        self._own_groups: list[dist.ProcessGroup] = []
        # Prioritized mode routes IDs on the host, on groups whose backend moves CPU tensors.
        self._host_channel: Channel | None = None
        # A leaf that requires grad, so that the lookup joins the autograd graph.
        self._dummy = torch.zeros(0, requires_grad=True)
        self._awaiting_backward: _Step | None = None
        self._prepared: Prepared | None = None
        # The rest of the last backward's gradient sync, submitted at the start of the next
        # step (after its critical-path collective, with its prefetch) or by ``synchronize``.
        self._deferred: DeferredGradients | None = None
        # The last backward's collision gradients on their way (prioritized mode), and why
        # the collection cannot go on if applying such an update failed.
        self._collision_update: CollisionUpdate | None = None
        self._failed: str | None = None
        self._expected_next: JaggedBatch | None = None
        # What a training pipeline staged for the next forward (``stage_next``).
        self._staged: _Staged | None = None
        self._worker: Worker | None = None
        self._background: Channel | None = None
        self._background_host: Channel | None = None
        if mode == "prioritized":
            # The same backend as the training thread's: it moves the same tensors (CUDA ones
            # cannot go through Gloo), and on ``freescale`` the prefetch stays off the SMs —
            # with the group's own options (a staged CUDA path must stay staged).
            backend = dist.get_backend(self.group)
            group = self.group if self.group is not None else dist.group.WORLD
            background_group = dist.new_group(
                ranks=dist.get_process_group_ranks(self.group),
                backend=backend,
                timeout=timeout,
                pg_options=getattr(group, "options", None) if backend == "freescale" else None,
            )
            self._own_groups.append(background_group)
            self._host_channel = self._host_channel_of(self._channel, timeout)
            self._background = Channel(background_group, self.device)
            self._background_host = self._host_channel_of(self._background, timeout)
            self._worker = Worker(timeout, stream_order(self.device))

    # -- public ----------------------------------------------------------------------------------

    @property
    def shard_tables(self) -> list[TableShard]:
        """This rank's table shards, in table order."""
        return [self.tables[t.name] for t in self.table_configs]

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
        self._staged = _Staged(next_batch, final, checked, next_on_host)

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
        self._check_usable()
        staged, self._staged = self._staged, None
        if staged is None or next_batch is not None or final:
            staged = _Staged(next_batch, final)
        self._channel.meter.take()
        problem = self._input_problem(batch, staged)
        index = self._last_step + 1
        if self.mode == "sync":
            step = self._sync_lookup(batch, index, problem)
        else:
            step = self._prioritized_lookup(batch, staged, index, problem)
        batch = step.batch if step.batch is not None else as_batch(batch)
        step.record.add_exposed(self._channel.meter.take())
        self.telemetry.append(step.record)
        outputs = _Lookup.apply(self._dummy, self, step)
        names = [name for shard in self.shards for name in shard.table.feature_names]
        result = {}
        for name, values in zip(names, outputs, strict=True):
            lengths = batch.features[name].lengths
            pooled = self.pooling != "none"
            result[name] = self._pool(values, lengths) if pooled else JaggedTensor(values, lengths)
        return result

    def synchronize(self) -> None:
        """Applies every pending background update before returning.

        In prioritized mode this finishes the last backward's gradient sync, which runs
        collectives on the prefetch group: call it (and ``state_dict``, ``load_state_dict``,
        ``close``) on every rank.
        """
        self._check_usable()
        self._finish_collisions(self.telemetry[-1] if self.telemetry else None)
        self._submit_deferred()
        if self._worker is not None:
            try:
                self._wait_worker()
            except EmbeddingInputError:
                if self._awaiting_backward is not None:
                    self._undo(self._awaiting_backward)
                raise

    def close(self) -> None:
        """Finishes background work, stops the prefetch thread and frees the process groups the
        collection made (also when finishing fails, which it raises)."""
        try:
            self.synchronize()
        finally:
            if self._worker is not None:
                self._worker.close()
                self._worker = None
            for group in self._own_groups:
                dist.destroy_process_group(group)
            self._own_groups.clear()

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
        self._prepared = None
        self._expected_next = None
        super()._load_from_state_dict(*args, **kwargs)
        self._last_step = int(self.step)

    # -- forward ---------------------------------------------------------------------------------

    def _input_problem(self, batch: Any, staged: _Staged) -> str | None:
        next_batch, final = staged.batch, staged.final
        try:
            jagged = as_batch(batch)
        except TypeError as error:
            return str(error)
        # A prioritized step's batch was checked as the previous step's next batch.
        checked = staged.checked or jagged is self._expected_next
        problem = self._batch_problem(jagged, checked)
        if problem is not None:
            return problem
        if self.mode == "sync":
            return None
        if not torch.is_grad_enabled():
            return "prioritized mode trains on every step: forward needs grad mode (use sync)"
        if self._awaiting_backward is not None:
            return (
                f"step {self._awaiting_backward.index} has not run its backward; prioritized "
                "mode needs every step's backward before the next forward"
            )
        if self._expected_next is not None:
            differs = same_ids(jagged, self._expected_next, self.shards)
            if differs is not None:
                return (
                    f"the batch differs from the next_batch given at the previous step "
                    f"(feature {differs!r})"
                )
        if next_batch is None:
            if not final:
                return (
                    "prioritized mode needs next_batch (the batch of the next step), or "
                    "final=True on the last step"
                )
            return None
        if final:
            return "final=True with a next_batch: a final step has no next step"
        try:
            jagged_next = as_batch(next_batch)
        except TypeError as error:
            return f"next batch: {error}"
        problem = self._batch_problem(jagged_next, staged.checked)
        return None if problem is None else f"next batch: {problem}"

    def _batch_problem(self, batch: JaggedBatch, checked: bool) -> str | None:
        """``batch_problem``; for a batch whose contents are ``checked``, only whether its
        features are there, on the tables' device (nothing read from the device)."""
        if not checked:
            return batch_problem(batch, self.shards, self.device)
        for shard in self.shards:
            for name in shard.table.feature_names:
                feature = batch.features.get(name)
                if feature is None:
                    return f"feature {name!r} (table {shard.table.name!r}) is not in the batch"
                if feature.values.device != self.device or feature.lengths.device != self.device:
                    return (
                        f"feature {name!r}: IDs and lengths must be on the tables' device "
                        f"{self.device}, got {feature.values.device} and {feature.lengths.device}"
                    )
        return None

    def _sync_lookup(self, batch: Any, index: int, problem: str | None) -> _Step:
        """Routes and looks up ``batch`` now; the preflight rides on the ID counts.

        Sync mode routes on the tables' device (idle at this point, and faster); prioritized
        mode's first step on the host, where the next step's prefetch plans with it.
        """
        features = as_batch(batch).features if problem is None else None
        host_routes: Routes | None = None
        if self._host_channel is None:
            ids = None if features is None else {n: f.values for n, f in features.items()}
            routes = route(ids, self.shards, self._channel, problem)
        else:
            ids = None if features is None else host_ids(features, self.shards)
            host_routes = route(ids, self.shards, self._host_channel, problem)
            routes = to_device(host_routes, self.device)
        assert routes is not None  # not final
        values = send_rows(self.shard_tables, routes, self._channel)
        return _Step(index, routes, host_routes, values, StepTelemetry(step=index))

    def _prioritized_lookup(
        self, batch: Any, staged: _Staged, index: int, problem: str | None
    ) -> _Step:
        prepared, expected = self._prepared, self._expected_next
        if prepared is None:
            step = self._sync_lookup(batch, index, problem)
        else:
            self._finish_collisions(prepared.record)
            if prepared.fallback:
                # Every row is fetched now, after the previous backward updated them all (with a
                # problem too: every peer is in this exchange).
                prepared.values = send_rows(self.shard_tables, prepared.routes, self._channel)
            step = _Step(
                index,
                prepared.routes,
                prepared.host_routes,
                prepared.values,
                prepared.record,
                batch=expected,
            )
        # This step's preflight rides on the next step's ID exchange, in the background, so
        # no collective of the critical path waits for it. Every rank, the one with the problem
        # too, returns outputs (that rank: the rows prefetched for the batch it announced) and
        # raises in its backward (``_await_next``), so that collectives the caller runs between
        # forward and backward (DDP's, metrics) pair up on every rank.
        final = staged.final
        jagged_next = None if final or problem is not None else as_batch(staged.batch)
        # Routing reads only IDs: from the host copy when the caller has one.
        routed = staged.on_host if staged.on_host is not None else jagged_next
        assert self._worker is not None
        assert self._background is not None and self._background_host is not None
        assert step.host_routes is not None  # routed on the host in prioritized mode
        # Every rank got here, bad input or not: the previous step's deferred sync goes with it.
        deferred, self._deferred = self._deferred, None
        step.next_future = self._worker.submit(
            prepare_next,
            self.shard_tables,
            self.shards,
            self._background,
            self._background_host,
            None if jagged_next is None or routed is None else routed.features,
            step.host_routes,
            self.max_collision_rate,
            StepTelemetry(step=index + 1),
            problem,
            deferred,
        )
        if problem is not None and not torch.is_grad_enabled():
            # No backward will follow: the error is raised now (it raises on every rank).
            self._wait_worker(step.next_future)
            raise AssertionError("a flagged preflight returned")
        self._prepared, self._expected_next = None, jagged_next
        step.undo = (prepared, expected, step.record.training_mark())
        self._awaiting_backward = step
        return step

    def _feature_outputs(self, step: _Step) -> list[torch.Tensor]:
        outputs = []
        for shard, values, inverse in zip(
            self.shards, step.values, step.routes.request.inverse, strict=True
        ):
            start = 0
            for name in shard.table.feature_names:
                count = step.routes.request.occurrences[name]
                outputs.append(values.index_select(0, inverse[start : start + count]))
                start += count
        return outputs

    def _pool(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        lengths = lengths.to(torch.int64)
        samples = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=lengths.device),
            lengths,
            output_size=values.shape[0],
        )
        # segment_sum, not index_add: the same bits in both modes on CUDA too.
        pooled = segment_sum(values, samples, lengths.numel())
        if self.pooling == "mean":
            pooled = pooled / lengths.clamp(min=1).to(values.dtype)[:, None]
        return pooled

    # -- backward --------------------------------------------------------------------------------

    def _backward(self, step: _Step, grads: Sequence[torch.Tensor]) -> None:
        if step.done:
            raise RuntimeError(
                f"backward of embedding step {step.index} ran twice; each step updates once"
            )
        step.done = True
        self._channel.meter.take()
        tables = self.shard_tables
        dtype = tables[0].weight.dtype
        per_table, start = [], 0
        for shard in self.shards:
            count = len(shard.table.feature_names)
            parts = [g.to(dtype) for g in grads[start : start + count]]
            # A lone feature's gradient is used as it is: cat would copy it on the critical path.
            per_table.append(parts[0] if count == 1 else torch.cat(parts))
            start += count
        optimizer = self.optimizer
        assert self._collision_update is None  # applied by this step's forward
        prepared = None if step.next_future is None else self._await_next(step)
        if prepared is None or prepared.fallback:
            # Sync mode, the last step of a prioritized run (whose earlier background updates
            # finished in ``_await_next``), or a step before a fallback: every row now.
            gradients = unique_gradients(step.routes.request, per_table)
            entry_gradients = send_gradients(tables, step.routes, gradients, self._channel)
            apply_gradients(tables, step.routes.serve, entry_gradients, optimizer, step.index)
            self._prepared = prepared
        else:
            self._prioritized_backward(step, per_table, optimizer, prepared)
        self.step.fill_(step.index)
        self._last_step = step.index
        if self._awaiting_backward is step:
            self._awaiting_backward = None
        step.record.add_exposed(self._channel.meter.take())

    def _await_next(self, step: _Step) -> Prepared | None:
        """The next step's ``Prepared`` (``None`` after the last step), which also carried this
        step's preflight: if some rank's call was invalid, the step is undone and the error
        raised here, on every rank."""
        assert self._worker is not None
        started = time.perf_counter()
        try:
            return self._wait_worker(step.next_future)
        except EmbeddingInputError:
            self._undo(step)
            raise
        finally:
            step.record.add_wait(time.perf_counter() - started)

    def _undo(self, step: _Step) -> None:
        """Back to before ``step``'s forward, whose call may then be made again."""
        assert step.undo is not None  # set by every prioritized forward
        self._prepared, self._expected_next, mark = step.undo
        step.record.rewind(mark)
        if self._awaiting_backward is step:
            self._awaiting_backward = None
        if self.telemetry and self.telemetry[-1] is step.record:
            self.telemetry.pop()

    def _prioritized_backward(
        self,
        step: _Step,
        occurrence_gradients: list[torch.Tensor],
        optimizer: Optimizer,
        prepared: Prepared,
    ) -> None:
        assert self._worker is not None and self._background is not None
        tables = self.shard_tables
        if prepared.plan is not None:
            # Only the collision rows' gradients, applied on their owners and to the next
            # step's prefetched copies at the next forward; the rest, in the background.
            self._collision_update = send_collision_gradients(
                tables,
                self._channel,
                step.routes.request,
                occurrence_gradients,
                prepared.plan,
                prepared.values,
                optimizer,
                step.index,
            )
        # Submitted at the start of the next step, so that it never competes with this step's
        # collision exchange.
        self._deferred = DeferredGradients(
            step.routes, occurrence_gradients, prepared.rest, optimizer, step.index, step.record
        )
        self._prepared = prepared

    def _finish_collisions(self, record: StepTelemetry | None) -> None:
        """Applies the last backward's collision update (before anything reads those rows);
        its wait counts in ``record``."""
        update, self._collision_update = self._collision_update, None
        if update is None:
            return
        try:
            # Whatever the caller's forward runs under: an optimizer step is no autograd op
            # and keeps its dtypes.
            with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
                apply_collisions(self.shard_tables, update)
        except BaseException as error:
            # The update cannot be made again (its collective is gone): training on would
            # read rows that miss it.
            self._fail(
                f"applying the collision gradients of step {update.step} failed "
                f"({type(error).__name__}: {error})"
            )
            raise
        if record is not None:
            record.add_exposed(self._channel.meter.take())

    def _host_channel_of(self, channel: Channel, timeout: timedelta) -> Channel:
        """A channel on the host for the thread that uses ``channel`` (measured with it)."""
        group = host_group(channel.group, self.device, timeout)
        if group is not channel.group:
            self._own_groups.append(group)
        return Channel(group, torch.device("cpu"), channel.meter)

    def _wait_worker(self, future: concurrent.futures.Future | None = None) -> Any:
        """``future``'s result (without one: every task's); a lost deferred update leaves the
        collection unusable."""
        assert self._worker is not None
        try:
            return self._worker.drain() if future is None else self._worker.wait(future)
        except UpdateLost as error:
            self._fail(str(error))
            raise

    def _fail(self, reason: str) -> None:
        """Leaves the collection unusable: an update of its tables was lost."""
        self._failed = (
            f"{reason}; the tables are incomplete: build a new collection and load a checkpoint"
        )

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise RuntimeError(self._failed)

    def _submit_deferred(self) -> None:
        if self._deferred is not None:
            assert self._worker is not None and self._background is not None
            deferred, self._deferred = self._deferred, None
            self._worker.submit(finish_gradients, self.shard_tables, self._background, deferred)

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
