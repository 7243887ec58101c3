"""Prioritized mode: step t+1's rows are prefetched during step t; only the rows both steps
read wait for step t's update, which reaches them through one AllToAll.

One step on the training thread::

    backward: collision rows' gradients to their owners and next-step requesters (started, not
              waited for)
    forward:  the previous backward's collision gradients arrive -> per-row sum -> optimizer, on
              the owners and on the prefetched copies (every other row was prefetched)

The collision rows of step t are those step t+1 reads too. The collision AllToAll moves while
the caller does what comes between a backward and the next forward (the dense optimizer step,
the next batch); ``synchronize`` finishes it too. The prefetch thread does the rest
(``prefetch``, ``collisions``), the preflight of a step included (``inputs``). The same bits as
sync mode.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from freescale_balance import JaggedBatch
from freescale_embed.channel import Channel, host_group
from freescale_embed.collisions import CollisionUpdate, apply_collisions, send_collision_gradients
from freescale_embed.inputs import EmbeddingInputError, as_batch, batch_problem, same_ids
from freescale_embed.optim import Optimizer
from freescale_embed.prefetch import (
    DeferredGradients,
    Prepared,
    UpdateLost,
    finish_gradients,
    prepare_next,
)
from freescale_embed.routing import Routes, host_ids, route
from freescale_embed.sharding import RowShard
from freescale_embed.step import NextStep, StagedCall, Step, StepUndo
from freescale_embed.streams import stream_order, to_device
from freescale_embed.tables import TableShard
from freescale_embed.telemetry import StepTelemetry
from freescale_embed.transfers import send_rows, sync_gradients
from freescale_embed.worker import Worker


class PrioritizedLookup:
    """The prioritized strategy of a ``ShardedEmbeddingCollection``, with its prefetch thread.

    Every rank constructs it at the same point: it creates a process group for the prefetch
    thread, with ``group``'s backend (and its options on ``freescale``: a staged CUDA path must
    stay staged), and, when that backend moves no CPU tensors (NCCL), a Gloo group for each
    thread's host collectives.

    Args:
        tables: this rank's table shards, in table order.
        shards: their row layouts.
        channel: the training thread's channel, on the tables' device.
        device: the tables' device.
        telemetry: the collection's step records (an undone step's record leaves it).
        max_collision_rate: the guardrail (``ShardedEmbeddingCollection``).
        timeout: bound on waits for the prefetch thread and on its group's collectives.
    """

    def __init__(
        self,
        tables: Sequence[TableShard],
        shards: Sequence[RowShard],
        channel: Channel,
        device: torch.device,
        telemetry: deque[StepTelemetry],
        max_collision_rate: float | None,
        timeout: timedelta,
    ) -> None:
        self._tables = list(tables)
        self._shards = list(shards)
        self._channel = channel
        self._device = device
        self._telemetry = telemetry
        self._max_collision_rate = max_collision_rate
        # On a GPU, the same backend as the training thread's: it moves the same tensors (CUDA
        # ones cannot go through Gloo), and on ``freescale`` the prefetch stays off the SMs. On
        # the CPU, Gloo: these collectives are off the critical path, and more traffic on the
        # freescale engine's Python thread takes the GIL from the training thread.
        group = channel.group
        backend = dist.get_backend(group) if device.type != "cpu" else "gloo"
        background_group = dist.new_group(
            ranks=dist.get_process_group_ranks(group),
            backend=backend,
            timeout=timeout,
            pg_options=getattr(group, "options", None) if backend == "freescale" else None,
        )
        # Groups made here, destroyed by ``close``.
        self.own_groups: list[dist.ProcessGroup] = [background_group]
        # Routing and planning read only IDs: on the host, on groups that move CPU tensors.
        self._host_channel = self._host_channel_of(channel, timeout)
        self.background = Channel(background_group, device)
        self._background_host = self._host_channel_of(self.background, timeout)
        self.worker: Worker | None = Worker(timeout, stream_order(device))
        # The next step as the prefetch thread prepared it, and the batch announced for it.
        self._prepared: Prepared | None = None
        self._announced: JaggedBatch | None = None
        # The rest of the last backward's gradient sync, submitted at the start of the next
        # step (after its critical-path collective, with its prefetch) or by ``synchronize``.
        self._deferred: DeferredGradients | None = None
        # The last backward's collision gradients on their way.
        self._collision_update: CollisionUpdate | None = None
        self._awaiting_backward: Step | None = None
        # Why the collection cannot go on: an update of its tables was lost.
        self._failure: str | None = None

    def check_usable(self) -> None:
        if self._failure is not None:
            raise RuntimeError(self._failure)

    def is_announced(self, batch: JaggedBatch) -> bool:
        """``batch`` is the one announced as the next batch at the previous step (its contents
        were checked then)."""
        return batch is self._announced

    def call_problem(self, batch: JaggedBatch, staged: StagedCall) -> str | None:
        """What prioritized mode asks of a call beyond its batch, or ``None``."""
        if not torch.is_grad_enabled():
            return "prioritized mode trains on every step: forward needs grad mode (use sync)"
        if self._awaiting_backward is not None:
            return (
                f"step {self._awaiting_backward.index} has not run its backward; prioritized "
                "mode needs every step's backward before the next forward"
            )
        if self._announced is not None:
            differs = same_ids(batch, self._announced, self._shards)
            if differs is not None:
                return (
                    f"the batch differs from the next_batch given at the previous step "
                    f"(feature {differs!r})"
                )
        if staged.next_batch is None:
            if not staged.final:
                return (
                    "prioritized mode needs next_batch (the batch of the next step), or "
                    "final=True on the last step"
                )
            return None
        if staged.final:
            return "final=True with a next_batch: a final step has no next step"
        try:
            next_batch = as_batch(staged.next_batch)
        except TypeError as error:
            return f"next batch: {error}"
        problem = batch_problem(next_batch, self._shards, self._device, checked=staged.checked)
        return None if problem is None else f"next batch: {problem}"

    def lookup(self, batch: Any, staged: StagedCall, index: int, problem: str | None) -> Step:
        """This step's rows (prefetched, or looked up now on a first step) and the next step's
        preparation, submitted to the prefetch thread."""
        prepared, announced = self._prepared, self._announced
        if prepared is None:
            routes, host_routes, values = self._lookup_now(batch, problem)
            record = StepTelemetry(step=index)
        else:
            self._finish_collisions(prepared.record)
            if prepared.fallback:
                # Every row is fetched now, after the previous backward updated them all (with a
                # problem too: every peer is in this exchange).
                prepared.values = send_rows(self._tables, prepared.routes, self._channel)
            routes, host_routes, values = prepared.routes, prepared.host_routes, prepared.values
            record = prepared.record
        # This step's preflight rides on the next step's ID exchange, in the background, so
        # no collective of the critical path waits for it. Every rank, the one with the problem
        # too, returns outputs (that rank: the rows prefetched for the batch it announced) and
        # raises in its backward (``_await_next``), so that collectives the caller runs between
        # forward and backward (DDP's, metrics) pair up on every rank.
        next_batch = None if staged.final or problem is not None else as_batch(staged.next_batch)
        # Routing reads only IDs: from the host copy when the caller has one.
        routed = staged.next_on_host if staged.next_on_host is not None else next_batch
        assert self.worker is not None
        # Every rank got here, bad input or not: the previous step's deferred sync goes with it.
        deferred, self._deferred = self._deferred, None
        future = self.worker.submit(
            prepare_next,
            self._tables,
            self._shards,
            self.background,
            self._background_host,
            None if next_batch is None or routed is None else routed.features,
            host_routes,
            self._max_collision_rate,
            StepTelemetry(step=index + 1),
            problem,
            deferred,
        )
        if problem is not None and not torch.is_grad_enabled():
            # No backward will follow: the error is raised now (it raises on every rank).
            self._wait_worker(future)
            raise AssertionError("a flagged preflight returned")
        self._prepared, self._announced = None, next_batch
        undo = StepUndo(prepared, announced, record.training_mark())
        step = Step(
            index,
            routes,
            values,
            record,
            announced=None if prepared is None else announced,
            next=NextStep(future, undo),
        )
        self._awaiting_backward = step
        return step

    def _lookup_now(
        self, batch: Any, problem: str | None
    ) -> tuple[Routes, Routes, list[torch.Tensor]]:
        """A first step's routing (on the host, where the next step's prefetch plans with it,
        and on the device) and rows; the preflight rides on the ID counts."""
        features = as_batch(batch).features if problem is None else None
        ids = None if features is None else host_ids(features, self._shards)
        host_routes = route(ids, self._shards, self._host_channel, problem)
        routes = to_device(host_routes, self._device)
        assert host_routes is not None and routes is not None  # not final
        return routes, host_routes, send_rows(self._tables, routes, self._channel)

    def backward(
        self, step: Step, occurrence_gradients: list[torch.Tensor], optimizer: Optimizer
    ) -> None:
        assert self._collision_update is None  # applied by this step's forward
        prepared = self._await_next(step)
        if prepared is None or prepared.fallback:
            # The last step of a run (whose earlier background updates finished in
            # ``_await_next``), or a step before a fallback: every row now.
            sync_gradients(
                self._tables,
                step.routes,
                occurrence_gradients,
                self._channel,
                optimizer,
                step.index,
            )
        else:
            if prepared.plan is not None:
                # Only the collision rows' gradients, applied on their owners and to the next
                # step's prefetched copies at the next forward; the rest, in the background.
                self._collision_update = send_collision_gradients(
                    self._tables,
                    self._channel,
                    step.routes.request,
                    occurrence_gradients,
                    prepared.plan,
                    prepared.values,
                    optimizer,
                    step.index,
                )
            # Submitted at the start of the next step, so that it never competes with this
            # step's collision exchange.
            self._deferred = DeferredGradients(
                step.routes, occurrence_gradients, prepared.rest, optimizer, step.index, step.record
            )
        self._prepared = prepared
        if self._awaiting_backward is step:
            self._awaiting_backward = None

    def synchronize(self, record: StepTelemetry | None) -> None:
        """Applies the collision update, then runs and waits for every background task; its
        exposed time counts in ``record``."""
        self._finish_collisions(record)
        if self._deferred is not None:
            assert self.worker is not None
            deferred, self._deferred = self._deferred, None
            self.worker.submit(finish_gradients, self._tables, self.background, deferred)
        if self.worker is not None:
            try:
                self._wait_worker()
            except EmbeddingInputError:
                if self._awaiting_backward is not None:
                    self._undo(self._awaiting_backward)
                raise

    def forget_prefetched(self) -> None:
        """Drops rows prefetched from tables about to be overwritten (the next forward looks
        its batch up afresh)."""
        self._prepared = None
        self._announced = None

    def close(self) -> None:
        """Stops the prefetch thread and frees the groups made here."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        for group in self.own_groups:
            dist.destroy_process_group(group)
        self.own_groups.clear()

    def _await_next(self, step: Step) -> Prepared | None:
        """The next step's ``Prepared`` (``None`` after the last step), which also carried this
        step's preflight: if some rank's call was invalid, the step is undone and the error
        raised here, on every rank."""
        assert step.next is not None  # set by every prioritized forward
        started = time.perf_counter()
        try:
            return self._wait_worker(step.next.future)
        except EmbeddingInputError:
            self._undo(step)
            raise
        finally:
            step.record.add_wait(time.perf_counter() - started)

    def _undo(self, step: Step) -> None:
        """Back to before ``step``'s forward, whose call may then be made again."""
        assert step.next is not None  # set by every prioritized forward
        undo = step.next.undo
        self._prepared, self._announced = undo.prepared, undo.announced
        step.record.rewind(undo.mark)
        if self._awaiting_backward is step:
            self._awaiting_backward = None
        if self._telemetry and self._telemetry[-1] is step.record:
            self._telemetry.pop()

    def _finish_collisions(self, record: StepTelemetry | None) -> None:
        """Applies the last backward's collision update (before anything reads those rows);
        its wait counts in ``record``."""
        update, self._collision_update = self._collision_update, None
        if update is None:
            return
        try:
            # Whatever the caller's forward runs under: an optimizer step is no autograd op
            # and keeps its dtypes.
            with torch.no_grad(), torch.autocast(self._device.type, enabled=False):
                apply_collisions(self._tables, update)
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
        group = host_group(channel.group, self._device, timeout)
        if group is not channel.group:
            self.own_groups.append(group)
        return Channel(group, torch.device("cpu"), channel.meter)

    def _wait_worker(self, future: concurrent.futures.Future | None = None) -> Any:
        """``future``'s result (without one: every task's); a lost deferred update leaves the
        collection unusable."""
        assert self.worker is not None
        try:
            return self.worker.drain() if future is None else self.worker.wait(future)
        except UpdateLost as error:
            self._fail(str(error))
            raise

    def _fail(self, reason: str) -> None:
        """Leaves the collection unusable: an update of its tables was lost."""
        self._failure = (
            f"{reason}; the tables are incomplete: build a new collection and load a checkpoint"
        )
