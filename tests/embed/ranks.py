"""Functions the test ranks run (importable by module path, as ``LocalGroup.run`` needs).

Every rank can rebuild every rank's batches from the workload configuration, so each rank checks
its own results against the dense reference of the whole global batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from freescale_balance import JaggedBatch, JaggedTensor
from freescale_embed import (
    SGD,
    Optimizer,
    ShardedEmbeddingCollection,
    TableConfig,
)
from freescale_embed._ops import segment_sum_pairwise
from freescale_embed.workload import WorkloadConfig, make_batch
from tests.embed.reference import DenseReference, loss_weights

# Two tables of different widths; "items" is read by two features. "tiny" has fewer rows than
# four ranks, so some rank owns none of it.
TABLES = (
    TableConfig("items", 400, 8, ["history", "candidates"]),
    TableConfig("categories", 61, 16, ["category"]),
    TableConfig("tiny", 3, 4, ["flag"]),
)


@dataclass(frozen=True)
class Case:
    """One training run, the same on every rank.

    Attributes:
        optimizer: fused optimizer (its ``lr`` is the first step's).
        collision_rate: share of each step's rows shared with the previous step (``None``: Zipf
            IDs over the whole table).
        steps: training steps.
        lr_decay: the learning rate is multiplied by this after every step.
        max_collision_rate: prioritized mode's guardrail.
        pooling: output pooling.
        tables: the tables.
        seed: workload seed.
        threads: intra-op threads of each rank during the run.
        synchronize_after: ``synchronize()`` runs after this step's backward (``None``: never).
    """

    optimizer: Optimizer = field(default_factory=lambda: SGD(lr=0.1))
    collision_rate: float | None = 0.05
    steps: int = 50
    lr_decay: float = 1.0
    max_collision_rate: float | None = None
    pooling: str = "none"
    tables: tuple[TableConfig, ...] = TABLES
    seed: int = 7
    threads: int = 1
    synchronize_after: int | None = 2

    def workload(self, world: int) -> WorkloadConfig:
        return WorkloadConfig(
            tables=self.tables,
            world_size=world,
            batch_size=6,
            rows_per_step=40,
            collision_rate=self.collision_rate,
            ids_per_rank=40,
            seed=self.seed,
        )

    def lr(self, step: int) -> float:
        return self.optimizer.lr * self.lr_decay**step


@dataclass
class Run:
    """What one rank saw of one training run."""

    outputs: list[dict[str, torch.Tensor]]
    state: dict[str, torch.Tensor]
    full: dict[str, torch.Tensor]
    initial: dict[str, torch.Tensor]
    telemetry: list[dict[str, Any]]


def _values(output: JaggedTensor | torch.Tensor) -> torch.Tensor:
    return output.values if isinstance(output, JaggedTensor) else output


def _loss(outputs: dict[str, Any], rank: int, step: int) -> torch.Tensor:
    tensors = [_values(o) for o in outputs.values()]
    weights = loss_weights(rank, step, [t.shape for t in tensors])
    return sum(((t * w).sum() for t, w in zip(tensors, weights, strict=True)), torch.zeros(()))


def train(
    case: Case, mode: str, batches: Sequence[JaggedBatch] | None = None, staged: bool = False
) -> Run:
    """Trains a fresh collection for ``case.steps`` steps in ``mode`` on this rank's batches
    (``staged``: each next batch given through ``stage_next``, as ``TrainPipeline`` does)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    workload = case.workload(world)
    threads = torch.get_num_threads()
    torch.set_num_threads(case.threads)
    try:
        if batches is None:
            batches = [make_batch(workload, rank, step) for step in range(case.steps)]
        return _train(case, mode, batches, staged)
    finally:
        torch.set_num_threads(threads)


def _host_copy(batch: JaggedBatch) -> JaggedBatch:
    """Another batch with the same IDs (what a pipeline holds on the host)."""
    return JaggedBatch(
        {n: JaggedTensor(f.values.clone(), f.lengths.clone()) for n, f in batch.features.items()},
        dict(batch.dense),
    )


def _train(case: Case, mode: str, batches: Sequence[JaggedBatch], staged: bool = False) -> Run:
    rank = dist.get_rank()
    emb = ShardedEmbeddingCollection(
        case.tables,
        optimizer=case.optimizer,
        mode=mode,
        pooling=case.pooling,
        max_collision_rate=case.max_collision_rate,
        seed=3,
    )
    initial = {
        key.split(".")[1]: value
        for key, value in emb.state_dict(full=True).items()
        if key.endswith(".weight")
    }
    outputs = []
    for step, batch in enumerate(batches):
        emb.set_learning_rate(case.lr(step))
        last = step + 1 == len(batches)
        following = None if last else batches[step + 1]
        if staged:
            # As TrainPipeline stages it: checked on the host, routed from a host copy.
            host = None if following is None else _host_copy(following)
            emb.stage_next(following, final=last, checked=True, next_on_host=host)
            out = emb(batch)
        elif mode == "sync":
            out = emb(batch)
        else:
            out = emb(batch, following, final=last)
        _loss(out, rank, step).backward()
        # A caller's collective on the same group (DDP, metrics) while prioritized mode's
        # collision gradients are still on their way: both must pair up on every rank.
        dist.all_reduce(torch.ones(1))
        if step == case.synchronize_after:
            # Finishing background work between steps (as state_dict does) applies the
            # pending collision update early; the next forward must not apply it again.
            emb.synchronize()
        outputs.append({k: _values(v).detach().clone() for k, v in out.items()})
    state = {k: v.clone() for k, v in emb.state_dict().items()}
    full = emb.state_dict(full=True)
    telemetry = [t.as_dict() for t in emb.telemetry]
    emb.close()
    return Run(outputs, state, full, initial, telemetry)


def _bitwise_equal(a: Run, b: Run) -> None:
    for step, (x, y) in enumerate(zip(a.outputs, b.outputs, strict=True)):
        for name in x:
            assert torch.equal(x[name], y[name]), f"output {name!r} of step {step} differs"
    assert a.state.keys() == b.state.keys()
    for key in a.state:
        assert torch.equal(a.state[key], b.state[key]), f"{key} differs"


def reference_run(case: Case, initial: dict[str, torch.Tensor]) -> tuple[DenseReference, list]:
    """The dense reference of ``case`` on the global batch; this rank's outputs per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    workload = case.workload(world)
    reference = DenseReference(case.tables, initial, case.optimizer)
    mine = []
    for step in range(case.steps):
        batches = [make_batch(workload, r, step) for r in range(world)]
        outputs = reference.step(
            batches, lambda r, shapes, s=step: loss_weights(r, s, shapes), case.lr(step)
        )
        mine.append(outputs[rank])
    return reference, mine


def modes_agree(case: Case, check_reference: bool = True) -> dict[str, Any]:
    """Sync and prioritized runs are bitwise equal; sync equals the dense reference."""
    sync = train(case, "sync")
    prioritized = train(case, "prioritized")
    _bitwise_equal(sync, prioritized)
    worst = 0.0
    if check_reference:
        reference, outputs = reference_run(case, sync.initial)
        for step, (got, want) in enumerate(zip(sync.outputs, outputs, strict=True)):
            for name in got:
                torch.testing.assert_close(
                    got[name],
                    want[name].float(),
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, s=step, n=name: f"step {s} feature {n}: {m}",
                )
        for table in case.tables:
            got = sync.full[f"tables.{table.name}.weight"]
            want = reference.weight[table.name].float()
            worst = max(worst, float((got - want).abs().max()))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    return {
        "collision_pct": [t["collision_pct"] for t in prioritized.telemetry],
        "lookup": [t["lookup"] for t in prioritized.telemetry],
        "worst_abs_diff": worst,
    }


def staged_modes_agree(case: Case) -> None:
    """Batches staged as ``TrainPipeline`` stages them (``stage_next`` with ``checked`` and a
    host copy of the next batch) give the bits of batches passed to ``forward``, in both
    modes."""
    sync = train(case, "sync")
    _bitwise_equal(sync, train(case, "sync", staged=True))
    _bitwise_equal(sync, train(case, "prioritized", staged=True))


def modes_agree_with_pairwise_sums(case: Case) -> dict[str, Any]:
    """``modes_agree`` with the segment sums tables on CUDA use (a fixed tree per row)."""
    with (
        mock.patch("freescale_embed.transfers.segment_sum", segment_sum_pairwise),
        mock.patch("freescale_embed.step.segment_sum", segment_sum_pairwise),
        mock.patch("freescale_embed.collisions.segment_sum", segment_sum_pairwise),
    ):
        return modes_agree(case)


def modes_agree_with_separate_host_groups(case: Case) -> dict[str, Any]:
    """``modes_agree`` with IDs and plans on Gloo groups of their own, as when the collection's
    group is NCCL (which moves no CPU tensors)."""

    def separate(group: dist.ProcessGroup, device: torch.device, timeout: Any) -> Any:
        ranks = dist.get_process_group_ranks(group)
        return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)

    made = []
    with (
        mock.patch("freescale_embed.prioritized_lookup.host_group", separate),
        mock.patch.object(ShardedEmbeddingCollection, "close", _recording_close(made)),
    ):
        result = modes_agree(case, check_reference=False)
    # A prioritized collection made its prefetch group and two host groups, and freed them.
    assert made == [3], made
    return result


def _recording_close(made: list[int]) -> Any:
    close = ShardedEmbeddingCollection.close

    def recording_close(self: ShardedEmbeddingCollection) -> None:
        prioritized = self.mode == "prioritized"
        if prioritized:
            made.append(len(self._strategy.own_groups))
        close(self)
        assert not prioritized or not self._strategy.own_groups

    return recording_close


def runs_repeat(case: Case) -> bool:
    """Two sync runs of the same case give the same bits."""
    _bitwise_equal(train(case, "sync"), train(case, "sync"))
    return True


def prefetch_group_backend() -> list[Any]:
    """A prioritized collection of CPU tables on a freescale subgroup with its own options: the
    prefetch thread's group is Gloo over the same ranks (off the critical path, and off the
    freescale engine's Python thread, which would take the GIL from the training thread)."""
    from freescale_comm import FreescaleOptions

    options = FreescaleOptions(cuda_path="staged", chunk_bytes=1 << 20)
    group = dist.new_group(backend="freescale", pg_options=options)
    table = TableConfig("items", 64, 4, ["history"])
    emb = ShardedEmbeddingCollection([table], group=group, mode="prioritized")
    try:
        background = emb._strategy.background.group
        return [dist.get_backend(background), dist.get_process_group_ranks(background)]
    finally:
        emb.close()
        dist.destroy_process_group(group)
