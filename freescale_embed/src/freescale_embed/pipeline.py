"""``TrainPipeline``: one FreeScale training step across every component, ``progress`` per step.

Per step t, on every rank::

    background thread   load batch t+2 -> [input exchange: has a batch, counts, schema, problems]
                        -> balance it (Balancer.shuffle) -> to the device
    training thread     wait for t+1 (loaded and balanced during t-1)
                        stage t+1 in every ShardedEmbeddingCollection (prioritized: prefetched now)
                        forward(t) -> per-sample losses -> [status: loss shape, finite, loss sum]
                        backward (embedding updates; DDP all-reduce of dense gradients, summed)
                        dense optimizer step
    background thread   per-sample outputs of t back to the ranks that loaded them (unshuffle)

Every collective of the balancer and of the input exchange is issued by the one background
thread (with a balancer, the balancer's own thread), in the order the training thread submits
the work, so the ranks' collectives pair whatever the timing. The input exchange agrees batch
sizes and schemas for the balancer too (it runs no preflight of its own), and each step's
gathered per-rank compute times go back to the balancer (``Balancer.observe``: VBS's exponent,
a cost model fit to measured times) on that thread, before the batches after it are balanced.
The loss is the sum of per-sample losses over the **global** weight
(samples or tokens, known before the step from the input exchange), and DDP sums gradients
instead of averaging them, so a sample's contribution to the gradient does not depend on where
it is computed or on how many samples a rank got.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import resource
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel

from freescale_balance import Balancer, JaggedBatch, JaggedTensor, ShufflePlan
from freescale_embed.channel import all_gather_tensor
from freescale_embed.collection import ShardedEmbeddingCollection
from freescale_embed.inputs import as_batch, batch_problem
from freescale_embed.pipeline_telemetry import RankStep, StepReport

Weights = Callable[[JaggedBatch], torch.Tensor]


class PipelineError(RuntimeError):
    """Raised identically on every rank when a step cannot run (bad input, bad loss, NaN)."""


@dataclass(frozen=True)
class PipelineConfig:
    """Settings of ``TrainPipeline``.

    Attributes:
        weights: per-sample integer weight of a batch (e.g. its tokens); the loss is divided by
            the global sum of weights. ``None``: one per sample (divide by the global samples).
        check_finite: stop every rank with ``PipelineError`` at a step whose loss is not
            finite, before its backward changes any table.
        return_outputs: send per-sample outputs back to the ranks that loaded them (with a
            balancer: one inverse shuffle per step on the background thread). ``False`` saves
            that traffic; ``StepOutput.outputs`` then raises. The same on every rank.
        timeout: bound of every wait for the background thread and of the pipeline's groups.
    """

    weights: Weights | None = None
    check_finite: bool = True
    return_outputs: bool = True
    timeout: timedelta = timedelta(seconds=120)


@dataclass
class StepOutput:
    """What ``progress`` returns for one step.

    Attributes:
        step: 1-based step of the pipeline.
        loss: this step's loss (the global sum of per-sample losses over the global weight).
        reports: the reports that became complete with this step (the previous step's; at the
            end of the data also this one's).
    """

    step: int
    loss: float
    reports: list[StepReport]
    _outputs: concurrent.futures.Future[dict[str, torch.Tensor]]
    _timeout_s: float

    @property
    def outputs(self) -> dict[str, torch.Tensor]:
        """Per-sample outputs of the samples this rank loaded, in loaded order (``"loss"`` and
        whatever else the model returned), detached, on the CPU.

        With a balancer they travel back on the background thread while the next step runs;
        reading them waits for their arrival.
        """
        try:
            return self._outputs.result(timeout=self._timeout_s)
        except concurrent.futures.TimeoutError:
            raise PipelineError(
                f"step {self.step}'s outputs did not come back within {self._timeout_s:.0f} s"
            ) from None


@dataclass
class _Input:
    """One step's batch as the background thread prepared it."""

    batch: JaggedBatch | None = None  # what this rank computes (balanced), on the device
    host_batch: JaggedBatch | None = None  # the same on the host, when the device is not
    plan: ShufflePlan | None = None
    local_weight: int = 0  # of ``batch``, the samples this rank computes
    global_samples: int = 0
    global_weight: int = 0
    exhausted: bool = False  # no rank has a batch: the data ended


def _empty_like(batch: JaggedBatch) -> JaggedBatch:
    return JaggedBatch(
        features={n: JaggedTensor(f.values[:0], f.lengths[:0]) for n, f in batch.features.items()},
        dense={n: t[:0] for n, t in batch.dense.items()},
    )


def batch_to_device(batch: JaggedBatch, device: torch.device) -> JaggedBatch:
    """``batch`` with every tensor on ``device`` (the same batch on the CPU)."""
    if device.type == "cpu":
        return batch
    return JaggedBatch(
        features={
            n: JaggedTensor(f.values.to(device), f.lengths.to(device))
            for n, f in batch.features.items()
        },
        dense={n: t.to(device) for n, t in batch.dense.items()},
    )


def _summed_all_reduce(group, bucket):  # unannotated: DDP checks annotations as objects
    """DDP comm hook: gradients are summed over ranks, not averaged (the loss is already over the
    global weight). Takes the process group and a ``dist.GradBucket``."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class TrainPipeline:
    """Trains a model that holds ``ShardedEmbeddingCollection``s, one ``progress`` call per step.

    The model takes a ``JaggedBatch`` and returns per-sample losses (a ``[batch]`` tensor), or a
    mapping with such a ``"loss"`` and other per-sample outputs; it calls its collections with
    the batch it received (the pipeline stages the next batch in them). The dense part is
    trained under DDP on ``group`` (gradients summed); the collections' fused optimizers train
    the tables inside backward. Construct it on every rank at the same point (it creates two
    Gloo groups).

    Args:
        model: the model; its collections are found through ``named_modules()``.
        optimizer: the dense optimizer (over the model's parameters).
        balancer: optional ``freescale_balance.Balancer``: each batch is balanced one step
            ahead, and per-sample outputs return to the ranks that loaded them.
        group: the group of the dense all-reduce (default: the world).
        device: where the model computes; batches are moved there.
        config: loss normalisation, finite check, timeout.

    Example::

        pipeline = TrainPipeline(model, torch.optim.Adam(model.parameters()),
                                 balancer=Balancer(BalancerConfig(policy="fbs")))
        iterator = iter(loader)
        while True:
            try:
                out = pipeline.progress(iterator)
            except StopIteration:
                break
        pipeline.close()
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        balancer: Balancer | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        config: PipelineConfig | None = None,
    ) -> None:
        self.config = config or PipelineConfig()
        self.model = model
        self.optimizer = optimizer
        self.balancer = balancer
        self.device = torch.device(device)
        self.collections = {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, ShardedEmbeddingCollection)
        }
        if not self.collections:
            raise ValueError(
                f"{type(model).__name__} holds no ShardedEmbeddingCollection: the pipeline "
                "trains models whose embeddings are sharded by freescale_embed"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        timeout = self.config.timeout
        # One group per thread, so the training thread's status exchange never meets the
        # background thread's input exchange.
        self._input_group = dist.new_group(backend="gloo", timeout=timeout)
        self._status_group = dist.new_group(backend="gloo", timeout=timeout)
        self._dense = self._wrap_dense(model)
        # With a balancer its thread is the background thread: loading, checking and balancing
        # a batch run there one after another, with no hand-off from one thread to another.
        self._worker = (
            None
            if balancer is not None
            else concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="freescale-pipeline"
            )
        )
        self._template: JaggedBatch | None = None
        self._queue: deque[concurrent.futures.Future[_Input]] | None = None
        self._iterator: Iterator[Any] | None = None
        self._pending: RankStep | None = None  # this rank's last step, not yet gathered
        self._pending_loss = 0.0
        self._pending_plan: ShufflePlan | None = None  # its balancing, for Balancer.observe
        self._fresh_reports: list[StepReport] = []  # gathered, not yet returned by progress
        self._seen_embedding: dict[tuple[str, int], tuple[float, float]] = {}
        self.step = 0

    # -- public ----------------------------------------------------------------------------------

    def progress(self, iterator: Iterator[Any]) -> StepOutput:
        """Runs one training step on the next batch of ``iterator``.

        ``iterator`` yields this rank's batches (``JaggedBatch`` or TorchRec
        ``KeyedJaggedTensor``); the pipeline reads two batches ahead on its background thread
        and holds each until its step has run (a loader must not refill their tensors).
        Ranks whose data ended compute empty batches while others still have some (with a
        balancer, they get samples of the others); when every rank's data has ended, ``progress``
        raises ``StopIteration`` on every rank, and the next call may start a new iterator.

        Raises:
            StopIteration: on every rank together, once no rank has a batch left.
            PipelineError: on every rank together: a rank's batch is malformed, differs in
                schema from other ranks' or from earlier steps, holds IDs out of range, the
                model's loss is not one value per sample, or the loss is not finite.
        """
        started = time.perf_counter()
        cpu_started = time.thread_time()
        if self._queue is None:
            self._start(iterator)
        elif iterator is not self._iterator:
            raise ValueError(
                "progress got another iterator before the current one ended: the pipeline has "
                "already read ahead of it"
            )
        assert self._queue is not None
        times = RankStep()
        current = self._wait_input(self._queue[0], times)
        if current.exhausted:
            self._queue = None
            self._iterator = None
            self._flush()
            raise StopIteration
        following = self._wait_input(self._queue[1], times)
        self._queue.popleft()
        if not following.exhausted:
            self._queue.append(self._submit(self._prepare, iterator))
        for collection in self.collections.values():
            # Every batch was checked on the host (``_prepare``), so the collections do not
            # check its IDs again on the device, and route the next one's from the host.
            collection.stage_next(
                following.batch,
                final=following.exhausted,
                checked=True,
                next_on_host=following.host_batch,
            )
        assert current.batch is not None
        self.step += 1
        loss, outputs = self._train(current, times)
        returned = self._return_outputs(outputs, current.plan)
        if self.device.type == "cuda":
            # Step times must cover the work queued on the GPU, not only its launch.
            torch.cuda.current_stream(self.device).synchronize()
        times.wall_s = time.perf_counter() - started
        times.thread_cpu_s = time.thread_time() - cpu_started
        self._measure(times)
        reports = self._take_reports()
        self._observe(reports)
        self._pending, self._pending_loss = times, loss
        self._pending_plan = current.plan
        if following.exhausted:
            reports += self._flush()
        return StepOutput(self.step, loss, reports, returned, self.config.timeout.total_seconds())

    @property
    def status_group(self) -> dist.ProcessGroup:
        """The Gloo group of the training thread's own exchanges (checkpoints coordinate on it)."""
        return self._status_group

    def close(self) -> None:
        """Stops the background thread and frees the pipeline's groups (not the collections).

        With a balancer, waits for the pipeline's work on its thread (the balancer's
        ``close`` stops that thread)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        else:
            self._submit(lambda: None).result(timeout=self.config.timeout.total_seconds())
        for group in (self._input_group, self._status_group):
            dist.destroy_process_group(group)

    # -- dense model ---------------------------------------------------------------------------

    def _wrap_dense(self, model: nn.Module) -> nn.Module:
        dense = [p for p in model.parameters() if p.requires_grad]
        if not dense:
            return model
        sharded = [
            f"{prefix}.{name}" if prefix else name
            for prefix, collection in self.collections.items()
            for name, _ in [*collection.named_parameters(), *collection.named_buffers()]
        ]
        # The collections' tables are sharded: DDP must neither broadcast nor reduce them.
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sharded)
        wrapped = DistributedDataParallel(model, process_group=self.group, device_ids=None)
        wrapped.register_comm_hook(self.group, _summed_all_reduce)
        return wrapped

    # -- background thread ---------------------------------------------------------------------

    def _submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Runs ``fn`` on the background thread after everything submitted before it."""
        if self._worker is not None:
            return self._worker.submit(fn, *args)
        assert self.balancer is not None
        return self.balancer.submit(fn, *args)

    def _start(self, iterator: Iterator[Any]) -> None:
        self._iterator = iterator
        self._queue = deque(self._submit(self._prepare, iterator) for _ in range(2))

    def _observe(self, reports: list[StepReport]) -> None:
        """Gives the balancer the previous step's per-rank compute times (gathered: the same on
        every rank), queued behind the batches already submitted, so every rank's balancer
        learns at the same point."""
        plan, balancer = self._pending_plan, self.balancer
        if plan is None or balancer is None:
            return
        for report in reports:
            if report.step == self.step - 1:
                self._submit(balancer.observe, plan, report.compute_s)

    def _prepare(self, iterator: Iterator[Any]) -> _Input:
        """Loads, checks and balances one batch (runs on the background thread)."""
        batch, problem = None, None
        try:
            batch = as_batch(next(iterator))
        except StopIteration:
            batch = None
        except Exception as error:  # a loader error must reach every rank, not only this one
            problem = f"the loader raised {type(error).__name__}: {error}"
        if batch is not None:
            problem = self._batch_problem(batch)
        if batch is not None and problem is None and self.balancer is not None:
            problem = self.balancer.problem(batch)
        weight = 0
        if batch is not None and problem is None:
            weight, problem = self._weight(batch)
        header = torch.tensor(
            [
                batch is not None and problem is None,
                0 if batch is None else batch.batch_size,
                weight,
                0 if batch is None else batch.schema_digest(),
                problem is not None,
            ],
            dtype=torch.int64,
        )
        gathered = all_gather_tensor(header, self._input_group)
        has, samples, weights, digests, flags = gathered.unbind(1)
        if bool(flags.any()):
            problems: list[str | None] = [None] * self.world_size
            dist.all_gather_object(problems, problem, group=self._input_group)
            lines = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
            raise PipelineError("cannot train on this batch:\n  " + "\n  ".join(lines))
        if not bool(has.any()):
            return _Input(exhausted=True)
        present = digests[has.bool()]
        if bool((present != present[0]).any()):
            lines = [
                f"rank {r}'s batch schema differs from rank {int(has.nonzero()[0])}'s"
                for r in range(self.world_size)
                if has[r] and digests[r] != present[0]
            ]
            raise PipelineError("cannot train on this batch:\n  " + "\n  ".join(lines))
        if batch is None:
            if self._template is None:
                raise PipelineError(
                    f"rank {self.rank}'s loader ended before its first batch while other ranks "
                    "still have batches"
                )
            batch = _empty_like(self._template)
        elif self._template is None:
            self._template = _empty_like(batch)
        plan, local_weight = None, weight
        if self.balancer is not None:
            # The exchange above agreed counts and schemas: no preflight of the balancer's.
            batch, plan = self.balancer.shuffle(batch, local_counts=samples)
            local_weight, _ = self._weight(batch)
        moved = batch_to_device(batch, self.device)
        return _Input(
            batch=moved,
            host_batch=None if moved is batch else batch,
            plan=plan,
            local_weight=local_weight,
            global_samples=int(samples.sum()),
            global_weight=int(weights.sum()),
        )

    def _batch_problem(self, batch: JaggedBatch) -> str | None:
        try:
            batch.validate()
        except ValueError as error:
            return str(error)
        if self._template is not None and batch.schema_digest() != self._template.schema_digest():
            return (
                "the batch's schema (features, dense fields, dtypes, shapes) differs from the "
                f"first batch's: {batch.schema()} against {self._template.schema()}"
            )
        cpu = torch.device("cpu")
        for name, collection in self.collections.items():
            problem = batch_problem(batch, collection.shards, cpu)
            if problem is not None:
                return f"{name or 'model'}: {problem}"
        return None

    def _weight(self, batch: JaggedBatch) -> tuple[int, str | None]:
        if self.config.weights is None:
            return batch.batch_size, None
        weights = self.config.weights(batch)
        if weights.shape != (batch.batch_size,) or weights.dtype.is_floating_point:
            return 0, (
                f"weights of a batch must be one integer per sample, got {weights.dtype} of "
                f"shape {tuple(weights.shape)} for {batch.batch_size} samples"
            )
        if weights.numel() and int(weights.min()) < 0:
            return 0, "weights of a batch must be non-negative"
        return int(weights.sum()), None

    def _wait_input(self, future: concurrent.futures.Future[_Input], times: RankStep) -> _Input:
        started = time.perf_counter()
        try:
            return future.result(timeout=self.config.timeout.total_seconds())
        except concurrent.futures.TimeoutError:
            raise PipelineError(
                f"the next batch was not loaded and balanced within "
                f"{self.config.timeout.total_seconds():.0f} s"
            ) from None
        finally:
            times.input_wait_s += time.perf_counter() - started

    # -- training thread -----------------------------------------------------------------------

    def _train(self, current: _Input, times: RankStep) -> tuple[float, dict[str, torch.Tensor]]:
        batch = current.batch
        assert batch is not None
        result = self._dense(batch)
        losses, problem = self._losses(result, batch.batch_size)
        # Checked on every rank before any backward, so a bad loss stops every rank here.
        local_sum = losses.sum() if problem is None else torch.zeros(())
        global_weight = max(current.global_weight, 1)
        started = time.perf_counter()
        total = self._status(problem, local_sum)
        times.status_wait_s += time.perf_counter() - started
        times.dense_allreduce_wait_s += _timed_backward(local_sum / global_weight)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        outputs = {"loss": losses.detach()}
        if isinstance(result, Mapping):
            outputs.update({k: v.detach() for k, v in result.items() if k != "loss"})
        times.samples = batch.batch_size
        times.tokens = current.local_weight
        return total / global_weight, outputs

    def _losses(self, result: Any, batch_size: int) -> tuple[torch.Tensor, str | None]:
        losses = result.get("loss") if isinstance(result, Mapping) else result
        if not isinstance(losses, torch.Tensor):
            return torch.zeros(0), (
                f"the model must return per-sample losses (a tensor, or a mapping with 'loss'), "
                f"got {type(losses).__name__}"
            )
        if losses.shape != (batch_size,) or not losses.dtype.is_floating_point:
            return losses, (
                f"the model's loss must be one float per sample: expected shape ({batch_size},), "
                f"got {losses.dtype} of shape {tuple(losses.shape)} (return per-sample losses; "
                "the pipeline divides their sum by the global sample or token count)"
            )
        return losses, None

    def _status(self, problem: str | None, local_sum: torch.Tensor) -> float:
        """Every rank learns whether every rank can go on, and the step's summed loss."""
        value = float(local_sum.detach())
        finite = value == value and abs(value) != float("inf")
        pending = self._pending if self._pending is not None else RankStep()
        header = torch.cat(
            [
                torch.tensor(
                    [problem is not None, self.config.check_finite and not finite, value],
                    dtype=torch.float64,
                ),
                torch.tensor([self._pending is not None, self._pending_loss], dtype=torch.float64),
                pending.to_tensor(),
            ]
        )
        gathered = all_gather_tensor(header, self._status_group)
        self._remember_reports(gathered[:, 3:], self.step - 1)
        if bool(gathered[:, 0].any()) or bool(gathered[:, 1].any()):
            problems: list[str | None] = [None] * self.world_size
            if not finite and problem is None and self.config.check_finite:
                problem = f"the loss of step {self.step} is not finite ({value})"
            dist.all_gather_object(problems, problem, group=self._status_group)
            lines = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
            raise PipelineError(f"step {self.step} cannot go on:\n  " + "\n  ".join(lines))
        return float(gathered[:, 2].sum())

    def _remember_reports(self, columns: torch.Tensor, step: int) -> None:
        """Turns a gathered step (a flag, its loss, every rank's ``RankStep``) into a report."""
        if not bool(columns[:, 0].all()):
            return
        ranks = [RankStep.from_tensor(row[2:]) for row in columns]
        self._fresh_reports.append(StepReport.of(step, float(columns[0, 1]), ranks))

    def _take_reports(self) -> list[StepReport]:
        taken, self._fresh_reports = self._fresh_reports, []
        return taken

    def _flush(self) -> list[StepReport]:
        """At the end of the data: gathers the last step's record (collective, every rank)."""
        if self._pending is None:
            return []
        header = torch.cat(
            [
                torch.tensor([1.0, self._pending_loss], dtype=torch.float64),
                self._pending.to_tensor(),
            ]
        )
        self._remember_reports(all_gather_tensor(header, self._status_group), self.step)
        self._pending = None
        return self._take_reports()

    def _return_outputs(
        self, outputs: dict[str, torch.Tensor], plan: ShufflePlan | None
    ) -> concurrent.futures.Future[dict[str, torch.Tensor]]:
        done: concurrent.futures.Future[dict[str, torch.Tensor]] = concurrent.futures.Future()
        if not self.config.return_outputs:
            done.set_exception(
                PipelineError("outputs are not returned: PipelineConfig(return_outputs=False)")
            )
            return done
        outputs = {k: v.cpu() for k, v in outputs.items()}
        if plan is None or self.balancer is None:
            done.set_result(outputs)
            return done
        balancer = self.balancer
        return self._submit(
            lambda: dict(balancer.unshuffle(JaggedBatch(dense=outputs), plan).dense)
        )

    def _measure(self, times: RankStep) -> None:
        for name, collection in self.collections.items():
            # Only the last records still change (a record is final after the next backward);
            # copying the whole deque would cost more every step.
            for record in itertools.islice(reversed(collection.telemetry), 3):
                key = (name, record.step)
                exposed, sent = self._seen_embedding.get(key, (0.0, 0.0))
                times.embedding_wait_s += record.exposed_comm_s - exposed
                times.embedding_bytes += record.bytes_sent - sent
                self._seen_embedding[key] = (record.exposed_comm_s, float(record.bytes_sent))
            latest = collection.telemetry[-1] if collection.telemetry else None
            if latest is not None:
                if latest.collision_pct is not None:
                    times.collision_pct = max(times.collision_pct, latest.collision_pct)
                times.prefetch_bytes += latest.prefetch_bytes
        for key in [k for k in self._seen_embedding if k[1] < self.step - 3]:
            del self._seen_embedding[key]
        times.host_bytes = resident_bytes()
        if self.device.type == "cuda":
            times.peak_device_bytes = float(torch.cuda.max_memory_allocated(self.device))


def resident_bytes() -> float:
    """This process's resident memory now (Linux), else its peak so far."""
    try:
        with open("/proc/self/statm") as statm:
            return float(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0


def _timed_backward(loss: torch.Tensor) -> float:
    """Runs ``loss.backward()``; returns how long it waited for DDP's all-reduce at its end.

    A callback queued when backward starts runs when the graph is done, before the one DDP
    queues once its last bucket is ready (which waits for every bucket's all-reduce): the time
    from it to the return of backward is that wait.
    """
    graph_done: list[float] = []

    def when_done() -> None:
        graph_done.append(time.perf_counter())

    def at_start(grad: torch.Tensor) -> torch.Tensor:
        Variable._execution_engine.queue_callback(when_done)
        return grad

    loss.register_hook(at_start)
    loss.backward()
    return time.perf_counter() - graph_done[0] if graph_done else 0.0
