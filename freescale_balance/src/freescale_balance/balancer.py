"""The balancing protocol over a process group, and its inverse.

Per batch, on every rank:

0. preflight: an AllGather of ``[local batch size, schema digest, local error]`` so a malformed or
   mismatched batch raises the same clear error on every rank before any sample moves;
I+II. AllGather of each sample's UIH length and candidate count (one collective, padded to the
   largest local batch);
III. the same deterministic partition on every rank, then the AllToAll shuffle of whole samples.

``unshuffle`` sends per-sample outputs (losses, predictions, or any batch) back to the ranks the
samples were loaded on, in their original order. Samples never leave their global batch.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from freescale_balance.autotune import AlphaAutoTuneConfig, AlphaAutoTuner
from freescale_balance.cost_fit import CostFitConfig, OnlineCostFit, group_rows
from freescale_balance.cost_model import CostModel
from freescale_balance.exchange import exchange_samples
from freescale_balance.jagged import JaggedBatch, JaggedBatchError
from freescale_balance.partition import (
    Partition,
    Policy,
    partition_or_keep,
    source_ranks,
    straggler_fraction,
    vbs_weights,
)

_T = TypeVar("_T")

# torch 2.13 renamed all_gather_into_tensor (deprecated there); 2.11 only has the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class BalanceError(RuntimeError):
    """Raised identically on every rank when some rank's input cannot be balanced."""


@dataclass
class BalancerConfig:
    """Settings of ``Balancer``.

    Attributes:
        policy: partition policy, ``"none" | "fbs" | "vbs" | "kk"``.
        length_feature: feature whose per-sample lengths are the UIH length (default: the first).
        candidates_field: optional dense field with each sample's number of candidates, added to
            its UIH length (the sequence the model attends over is history + candidates).
        cost_model: per-sample cost for ``fbs``/``kk`` (until ``fit`` replaces it).
        fit: refit ``fbs``/``kk``'s cost model to the per-rank compute times given to
            ``observe`` (least squares of ``a*L^2 + b*L + c``, identical on every rank).
            ``None``: keep ``cost_model``.
        autotune: ``vbs`` exponent tuning; ``alpha`` starts at ``autotune.initial_alpha``.
        timeout: bound of every collective on the balancer's own group.
        min_gain: a batch whose partition lowers the slowest rank's cost (under the policy's
            costs) by less than this fraction of it stays where it was loaded: no sample moves
            and no AllToAll runs. The shuffle costs the two AllToAlls and the packing whatever
            the gain, so a gain smaller than that is a loss. Every rank decides the same from
            the gathered lengths. ``0``: every batch is partitioned by the policy.
    """

    policy: Policy = "fbs"
    length_feature: str | None = None
    candidates_field: str | None = None
    cost_model: CostModel = field(default_factory=CostModel)
    fit: CostFitConfig | None = None
    autotune: AlphaAutoTuneConfig = field(default_factory=AlphaAutoTuneConfig)
    timeout: timedelta = timedelta(seconds=120)
    min_gain: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")


@dataclass(frozen=True)
class ShufflePlan:
    """How one batch moved; everything ``unshuffle`` needs to send outputs back.

    Attributes:
        partition: destination rank of every sample of the global batch.
        sequence_lengths: int64, UIH length + candidates of every sample of the global batch.
        local_counts: int64 ``[world]``, local batch size each rank loaded.
        destinations: int64, the rank each of this rank's loaded samples goes to.
        send_counts: int64 ``[world]``, samples this rank sent to each rank.
        recv_counts: int64 ``[world]``, samples this rank received from each rank.
        costs: per-sample cost the partition balanced.
        kept: every sample stays where it was loaded (``min_gain`` not reached, or the
            partition moved none): ``shuffle`` returned the local batch as it was.
    """

    partition: Partition
    sequence_lengths: torch.Tensor
    local_counts: torch.Tensor
    destinations: torch.Tensor
    send_counts: torch.Tensor
    recv_counts: torch.Tensor
    costs: torch.Tensor
    kept: bool = False

    def straggler(self) -> float:
        """Predicted straggler fraction of the balanced batch, under ``costs``."""
        return straggler_fraction(self.partition.loads(self.costs))

    def unbalanced_straggler(self) -> float:
        """Predicted straggler fraction had every sample stayed where it was loaded."""
        unbalanced = Partition(source_ranks(self.local_counts), self.partition.world_size)
        return straggler_fraction(unbalanced.loads(self.costs))


class BalanceFuture:
    """An in-flight balancing step; ``wait()`` returns its result or raises its error."""

    def __init__(self, future: concurrent.futures.Future, timeout: timedelta) -> None:
        self._future = future
        self._timeout = timeout

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: timedelta | None = None):
        bound = (timeout or self._timeout).total_seconds()
        try:
            return self._future.result(timeout=bound)
        except concurrent.futures.TimeoutError:
            raise BalanceError(f"balancing step did not finish within {bound:.0f} s") from None


class Balancer:
    """Balances jagged batches across the ranks of a process group.

    Every collective of a balancer runs on its one thread, in the order the calls were made,
    whichever thread makes them and whether they are asynchronous or not: a synchronous
    ``unshuffle`` of step t issued while step t+1's ``shuffle_async`` is in flight runs after it
    on every rank, so the ranks' collectives always pair.

    Args:
        config: policy, cost model and timeouts.
        group: process group whose ranks share the global batch. By default a dedicated Gloo group
            over all ranks is created (collectively, so every rank must construct its Balancer
            at the same point), so asynchronous balancing never interleaves with the caller's
            own collectives on another group.

    Example::

        balancer = Balancer(BalancerConfig(policy="fbs", length_feature="item_ids"))
        batch, plan = balancer.shuffle(local_batch)        # samples now on assigned ranks
        losses = model(batch)                              # one loss per received sample
        my_losses = balancer.unshuffle(losses, plan)       # back in local_batch's order
    """

    def __init__(
        self, config: BalancerConfig | None = None, group: dist.ProcessGroup | None = None
    ) -> None:
        self.config = config or BalancerConfig()
        if group is None:
            group = dist.new_group(backend="gloo", timeout=self.config.timeout)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.tuner = AlphaAutoTuner(self.config.autotune)
        self.cost_fit = (
            None
            if self.config.fit is None
            else OnlineCostFit(self.config.fit, self.config.cost_model)
        )
        # Every partition so far, hashed: two runs with equal digests placed every sample alike.
        self._partitions = hashlib.sha256()
        self._thread_id: int | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="freescale-balance", initializer=self._on_thread
        )

    def _on_thread(self) -> None:
        self._thread_id = threading.get_ident()

    @property
    def partition_digest(self) -> str:
        """A hash of every partition this balancer has planned, in order."""
        return self._partitions.hexdigest()[:16]

    @property
    def cost_model(self) -> CostModel:
        """The cost model ``fbs``/``kk`` balance with now (fit online with ``config.fit``)."""
        return self.config.cost_model if self.cost_fit is None else self.cost_fit.model

    # -- collective helpers ------------------------------------------------------------------

    def _all_gather(self, local: torch.Tensor) -> torch.Tensor:
        gathered = torch.empty(self.world_size * local.numel(), dtype=local.dtype)
        _all_gather_single(gathered, local.reshape(-1), group=self.group)
        return gathered.reshape(self.world_size, *local.shape)

    def _preflight(self, problem: str | None, digest: int, local_count: int) -> torch.Tensor:
        """Agrees on sizes and schema, or raises the same ``BalanceError`` on every rank."""
        header = self._all_gather(
            torch.tensor([local_count, digest, problem is not None], dtype=torch.int64)
        )
        digests = header[:, 1]
        if bool(header[:, 2].any()) or bool((digests != digests[0]).any()):
            problems: list = [None] * self.world_size
            dist.all_gather_object(problems, problem, group=self.group)
            lines = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
            if not lines:
                lines = [
                    f"rank {r} has a batch schema different from rank 0's"
                    for r in range(self.world_size)
                    if digests[r] != digests[0]
                ]
            raise BalanceError("cannot balance this batch:\n  " + "\n  ".join(lines))
        return header[:, 0]

    # -- stages --------------------------------------------------------------------------------

    def problem(self, batch: JaggedBatch) -> str | None:
        """What makes ``batch`` unbalanceable on this rank (local, no collective), or ``None``.

        A caller that agrees batch sizes and schemas with every rank itself (``TrainPipeline``)
        checks this first and then passes ``local_counts`` to ``shuffle``.
        """
        try:
            batch.validate()
            self._sequence_lengths(batch)
        except (JaggedBatchError, ValueError) as error:
            return str(error)
        return None

    def _sequence_lengths(self, batch: JaggedBatch) -> torch.Tensor:
        config = self.config
        if not batch.features:
            raise JaggedBatchError("balancing needs a jagged feature to take UIH lengths from")
        name = config.length_feature or next(iter(batch.features))
        if name not in batch.features:
            raise JaggedBatchError(f"length feature {name!r} is not in the batch")
        lengths = batch.features[name].lengths.to(torch.int64)
        if config.candidates_field is not None:
            candidates = batch.dense.get(config.candidates_field)
            if candidates is None:
                raise JaggedBatchError(f"candidates field {config.candidates_field!r} is missing")
            if candidates.dtype.is_floating_point or candidates.dim() != 1:
                raise JaggedBatchError(
                    f"candidates field {config.candidates_field!r} must be a 1-D integer tensor"
                )
            if candidates.numel() and int(candidates.min()) < 0:
                raise JaggedBatchError("candidate counts must be non-negative")
            lengths = lengths + candidates.to(torch.int64)
        return lengths

    def _costs(self, lengths: torch.Tensor) -> torch.Tensor:
        if self.config.policy == "vbs":
            return vbs_weights(lengths, self.tuner.alpha)
        return self.cost_model(lengths)

    def plan(self, batch: JaggedBatch, local_counts: torch.Tensor | None = None) -> ShufflePlan:
        """Preflight, stages I+II and the partition: where every sample goes (no samples move).

        Args:
            local_counts: every rank's local batch size (int64 ``[world]``), when the caller has
                already agreed them and the batches' schema digests with every rank and found
                no rank's ``problem``: the preflight is skipped. The same on every rank.
        """
        return self._in_order(self._plan, batch, local_counts)

    def _plan(self, batch: JaggedBatch, local_counts: torch.Tensor | None = None) -> ShufflePlan:
        if local_counts is None:
            problem = self.problem(batch)
            local_counts = self._preflight(problem, batch.schema_digest(), batch.batch_size)
        elif int(local_counts[self.rank]) != batch.batch_size:
            raise BalanceError(
                f"local_counts says rank {self.rank} holds {int(local_counts[self.rank])} "
                f"samples, its batch holds {batch.batch_size}"
            )
        local = self._sequence_lengths(batch)
        padded = torch.full((int(local_counts.max()),), -1, dtype=torch.int64)
        padded[: local.numel()] = local
        gathered = self._all_gather(padded)
        valid = torch.arange(gathered.shape[1])[None, :] < local_counts[:, None]
        lengths = gathered[valid]
        costs = self._costs(lengths)
        assignment = partition_or_keep(
            costs, self.world_size, self.config.policy, local_counts, self.config.min_gain
        )
        self._partitions.update(assignment.ranks.to(torch.int64).numpy().tobytes())
        sources = source_ranks(local_counts)
        kept = bool(torch.equal(assignment.ranks, sources))
        offset = int(local_counts[: self.rank].sum())
        mine = assignment.ranks[offset : offset + batch.batch_size]
        return ShufflePlan(
            partition=assignment,
            sequence_lengths=lengths,
            local_counts=local_counts,
            destinations=mine,
            send_counts=torch.bincount(mine, minlength=self.world_size),
            recv_counts=torch.bincount(
                sources[assignment.ranks == self.rank], minlength=self.world_size
            ),
            costs=costs,
            kept=kept,
        )

    def shuffle(
        self, batch: JaggedBatch, local_counts: torch.Tensor | None = None
    ) -> tuple[JaggedBatch, ShufflePlan]:
        """Moves each sample of the global batch to its assigned rank.

        Args:
            local_counts: as for ``plan`` (skips the preflight).

        Returns:
            The samples this rank computes (in global-batch order) and the plan to undo it.
        """
        return self._in_order(self._shuffle, batch, local_counts)

    def _shuffle(
        self, batch: JaggedBatch, local_counts: torch.Tensor | None = None
    ) -> tuple[JaggedBatch, ShufflePlan]:
        plan = self._plan(batch, local_counts)
        if plan.kept:  # every rank knows: no sample moves anywhere
            return batch, plan
        return exchange_samples(batch, plan.destinations, plan.recv_counts, self.group), plan

    def unshuffle(
        self, outputs: JaggedBatch | torch.Tensor, plan: ShufflePlan
    ) -> JaggedBatch | torch.Tensor:
        """Returns per-sample outputs to the rank each sample was loaded on, in loaded order.

        Args:
            outputs: one row (tensor) or one sample (batch) per sample this rank received.
            plan: the plan ``shuffle`` returned for that batch.
        """
        return self._in_order(self._unshuffle, outputs, plan)

    def _unshuffle(
        self, outputs: JaggedBatch | torch.Tensor, plan: ShufflePlan
    ) -> JaggedBatch | torch.Tensor:
        batch = outputs if isinstance(outputs, JaggedBatch) else JaggedBatch(dense={"": outputs})
        expected = int(plan.recv_counts.sum())
        problem = None
        try:
            batch.validate()
            if batch.batch_size != expected:
                problem = f"outputs hold {batch.batch_size} samples; this rank received {expected}"
        except JaggedBatchError as error:
            problem = str(error)
        self._preflight(problem, batch.schema_digest(), batch.batch_size)
        sources = torch.repeat_interleave(torch.arange(self.world_size), plan.recv_counts)
        restored = exchange_samples(
            batch, sources, plan.send_counts, self.group, combine_ranks=plan.destinations
        )
        return restored if isinstance(outputs, JaggedBatch) else restored.dense[""]

    # -- asynchronous forms ----------------------------------------------------------------------

    def shuffle_async(self, batch: JaggedBatch) -> BalanceFuture:
        """``shuffle`` on the balancer's thread, so batch t+1 balances while batch t computes.

        Steps run in submission order; ``wait()`` gives ``(batch, plan)``.
        """
        return BalanceFuture(self._executor.submit(self._shuffle, batch), self.config.timeout)

    def unshuffle_async(
        self, outputs: JaggedBatch | torch.Tensor, plan: ShufflePlan
    ) -> BalanceFuture:
        """``unshuffle`` on the balancer's thread, after every step submitted before it."""
        return BalanceFuture(
            self._executor.submit(self._unshuffle, outputs, plan), self.config.timeout
        )

    def report_step_time(self, plan: ShufflePlan, seconds: float) -> float:
        """Collective: shares this rank's measured time of the step and tunes the VBS exponent.

        Returns:
            The exponent the next ``vbs`` plan uses.
        """
        return self._in_order(self._report_step_time, plan, seconds)

    def _report_step_time(self, plan: ShufflePlan, seconds: float) -> float:
        times = self._all_gather(torch.tensor([seconds], dtype=torch.float64)).flatten()
        return self._tune(plan, times)

    def _tune(self, plan: ShufflePlan, times: torch.Tensor) -> float:
        """Tunes the VBS exponent from every rank's time of the step ``plan`` balanced."""
        groups = [plan.sequence_lengths[plan.partition.ranks == r] for r in range(self.world_size)]
        return self.tuner.update(groups, times)

    def observe(self, plan: ShufflePlan, seconds: Sequence[float]) -> None:
        """Learns from every rank's measured compute time of the step ``plan`` balanced.

        ``vbs`` tunes its exponent; ``fbs``/``kk`` refit their cost model when ``config.fit``
        is set. No collective: ``seconds`` (one per rank) must be the same on every rank (e.g.
        gathered) and observed at the same point of the call order on every rank (``submit``
        it), so every rank balances the next batches alike.
        """
        self._in_order(self._observe, plan, list(seconds))

    def _observe(self, plan: ShufflePlan, seconds: list[float]) -> None:
        if len(seconds) != self.world_size:
            raise ValueError(f"{len(seconds)} times for {self.world_size} ranks")
        if self.config.policy == "vbs":
            self._tune(plan, torch.tensor(seconds, dtype=torch.float64))
        elif self.cost_fit is not None and self.config.policy in ("fbs", "kk"):
            rows = group_rows(plan.sequence_lengths, plan.partition.ranks, self.world_size)
            self.cost_fit.observe(rows, seconds)

    def submit(self, fn: Callable[..., _T], *args: Any) -> concurrent.futures.Future[_T]:
        """Runs ``fn(*args)`` on the balancer's thread after every call submitted before it.

        ``fn`` may call the balancer's synchronous methods (they run at once there), so a
        caller with background work around balancing (``TrainPipeline``: load, check, balance)
        runs it on this one thread instead of handing each batch from its own thread to this.
        """
        return self._executor.submit(fn, *args)

    def _in_order(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Runs ``fn`` on the balancer's thread after every call submitted before it (at once
        when called from that thread)."""
        if threading.get_ident() == self._thread_id:
            return fn(*args)
        return BalanceFuture(self._executor.submit(fn, *args), self.config.timeout).wait()

    def close(self) -> None:
        """Finishes pending steps and stops the balancer's thread."""
        self._executor.shutdown(wait=True)
