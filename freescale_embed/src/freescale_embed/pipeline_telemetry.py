"""Where a training step's time went, on every rank and for the step as a whole.

Each rank measures its own step (``RankStep``); the pipeline gathers every rank's record in the
next step's status exchange, and ``StepReport.of`` turns them into the step's figures:

- ``step_s``: the slowest rank's wall time;
- ``compute_s``: per rank, wall time minus the time the training thread waited (for its input,
  for embedding collectives, for the dense all-reduce, for the status exchange);
- ``straggler_pct = (max - mean) / max`` of ``compute_s``, and ``straggler_wait_s = max - mean``:
  what the ranks idle on average because one computes longer;
- exposed communication, per kind, as the waits of the rank that computed longest: that rank
  arrives last at every collective, so what it waits for is communication, not peers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class RankStep:
    """One rank's measurements of one step (seconds, counts, bytes).

    Attributes:
        wall_s: from the start of ``progress`` to its return.
        thread_cpu_s: CPU time of the training thread in that span (below ``wall_s`` minus
            waits when the thread was ready but did not run: other threads held the GIL or
            the cores).
        input_wait_s: waiting for the next batches to be loaded and balanced.
        embedding_wait_s: the training thread in embedding collectives or waiting for the
            embedding prefetch thread (the collections' ``exposed_comm_s``).
        dense_allreduce_wait_s: backward waiting for the dense gradients' all-reduce (DDP).
        status_wait_s: the status exchange before backward (loss shape, finite loss).
        samples: samples this rank computed.
        tokens: weight units (tokens, or samples) this rank computed.
        embedding_bytes: bytes the embedding collections sent during the step.
        collision_pct: the embedding step's collision share, or -1 when not measured.
        prefetch_bytes: bytes held from the previous step for this one (prioritized mode).
        host_bytes: this process's resident memory at the step's end.
        peak_device_bytes: peak device memory allocated so far (0 on CPU).
    """

    wall_s: float = 0.0
    thread_cpu_s: float = 0.0
    input_wait_s: float = 0.0
    embedding_wait_s: float = 0.0
    dense_allreduce_wait_s: float = 0.0
    status_wait_s: float = 0.0
    samples: float = 0.0
    tokens: float = 0.0
    embedding_bytes: float = 0.0
    collision_pct: float = -1.0
    prefetch_bytes: float = 0.0
    host_bytes: float = 0.0
    peak_device_bytes: float = 0.0

    @property
    def waited_s(self) -> float:
        return (
            self.input_wait_s
            + self.embedding_wait_s
            + self.dense_allreduce_wait_s
            + self.status_wait_s
        )

    @property
    def compute_s(self) -> float:
        return max(self.wall_s - self.waited_s, 0.0)

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(dataclasses.astuple(self), dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> RankStep:
        return cls(*[float(v) for v in values.tolist()])

    @classmethod
    def width(cls) -> int:
        return len(dataclasses.fields(cls))


@dataclass(frozen=True)
class StepReport:
    """One training step over all ranks.

    Attributes:
        step: 1-based step of the pipeline.
        loss: the step's loss: every rank's summed per-sample losses over the global weight.
        step_s: the slowest rank's wall time.
        compute_s: per rank, wall time minus waits.
        thread_cpu_s: per rank, the training thread's CPU time.
        straggler_pct: ``(max - mean) / max`` of ``compute_s``, in percent.
        straggler_wait_s: ``max - mean`` of ``compute_s``.
        exposed_s: per kind (``input``, ``embedding``, ``dense_allreduce``, ``status``), the
            waits of the rank that computed longest.
        samples: global samples of the step.
        tokens: global weight units (tokens, or samples).
        samples_per_s: ``samples / step_s``.
        tokens_per_s: ``tokens / step_s``.
        collision_pct: mean over ranks of the embedding collision share (``None``: not measured).
        embedding_bytes: bytes all ranks' embedding collections sent.
        prefetch_bytes: the most any rank held from the previous step for this one.
        host_bytes: the largest resident memory of a rank at the step's end.
        peak_device_bytes: the largest peak device memory of a rank.
    """

    step: int
    loss: float
    step_s: float
    compute_s: tuple[float, ...]
    thread_cpu_s: tuple[float, ...]
    straggler_pct: float
    straggler_wait_s: float
    exposed_s: dict[str, float]
    samples: int
    tokens: int
    samples_per_s: float
    tokens_per_s: float
    collision_pct: float | None
    embedding_bytes: int
    prefetch_bytes: int
    host_bytes: int
    peak_device_bytes: int

    @classmethod
    def of(cls, step: int, loss: float, ranks: Sequence[RankStep]) -> StepReport:
        compute = [r.compute_s for r in ranks]
        slowest = max(compute)
        mean = sum(compute) / len(compute)
        critical = ranks[compute.index(slowest)]
        step_s = max(r.wall_s for r in ranks)
        samples = round(sum(r.samples for r in ranks))
        tokens = round(sum(r.tokens for r in ranks))
        collisions = [r.collision_pct for r in ranks if r.collision_pct >= 0]
        return cls(
            step=step,
            loss=loss,
            step_s=step_s,
            compute_s=tuple(compute),
            thread_cpu_s=tuple(r.thread_cpu_s for r in ranks),
            straggler_pct=100.0 * (slowest - mean) / slowest if slowest > 0 else 0.0,
            straggler_wait_s=slowest - mean,
            exposed_s={
                "input": critical.input_wait_s,
                "embedding": critical.embedding_wait_s,
                "dense_allreduce": critical.dense_allreduce_wait_s,
                "status": critical.status_wait_s,
            },
            samples=samples,
            tokens=tokens,
            samples_per_s=samples / step_s if step_s > 0 else 0.0,
            tokens_per_s=tokens / step_s if step_s > 0 else 0.0,
            collision_pct=sum(collisions) / len(collisions) if collisions else None,
            embedding_bytes=round(sum(r.embedding_bytes for r in ranks)),
            prefetch_bytes=round(max(r.prefetch_bytes for r in ranks)),
            host_bytes=round(max(r.host_bytes for r in ranks)),
            peak_device_bytes=round(max(r.peak_device_bytes for r in ranks)),
        )

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)
