"""Straggler and compute bubble at many ranks, simulated on one device with the real model.

For each world size ``N`` and maximum history ``M``: every step draws a global batch of
``N * local_batch`` history lengths from the synthetic data's length model, assigns its samples
to ranks with each policy exactly as ``Balancer`` does (``partition_or_keep``; VBS tunes its
exponent from the measured times, step after step), and then runs the real SASRec forward and
backward of each of the ``N`` ranks' samples, one rank after another, on the device. A step's
compute time is its slowest rank's; ``straggler % = (max - mean) / max`` and the compute
bubble ``max - mean`` is what the other ranks idle on average.

The item table is a plain local table here: the sharded table's lookup is communication, not
compute, and every policy's ranks read as many rows. Item IDs are drawn uniformly (the cost of
a lookup does not depend on which row it reads). A rank whose samples equal an already timed
rank's of the same step (a policy that kept the batch where it was loaded) reuses that time.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from freescale_balance import (
    AlphaAutoTuner,
    CostModel,
    JaggedBatch,
    JaggedTensor,
    partition_or_keep,
    vbs_weights,
)
from freescale_balance.simulate import LengthDistribution
from freescale_embed.config import TableConfig
from freescale_embed.models import SASRec, SASRecConfig, cost_model, item_tables

POLICIES: tuple[str, ...] = ("none", "fbs", "kk", "vbs")


@dataclass(frozen=True)
class ScaleConfig:
    """What the simulation sweeps, and the model it times.

    Attributes:
        world_sizes: simulated ranks ``N``.
        max_histories: maximum history lengths ``M``.
        local_batch: samples per rank (the global batch is ``N * local_batch``).
        steps: steps per point (each policy sees the same global batches).
        rank_runs_per_point: fewer steps (at least one) where ``steps`` would time more
            ranks than this at one point (``None``: no bound).
        policies: balancing policies (``none`` is the baseline).
        min_gain: ``BalancerConfig.min_gain`` of the balanced policies.
        min_history: shortest history (the synthetic data's).
        embedding_dim: model width.
        num_layers: transformer blocks.
        num_heads: attention heads.
        num_negatives: sampled negatives per sample.
        num_items: rows of the item table.
        device: where the ranks' forward and backward run.
        tf32: TensorFloat-32 matmuls on CUDA.
        budget_s: points whose projected time would pass this bound are skipped (``None``:
            none are).
        calibrate: FBS and KK balance with a cost model fit to this device's measured rank
            times (``CostModel.fit_groups`` over ``calibration_ranks`` ranks per maximum
            history, timed before the sweep); ``False``: ``freescale train``'s FLOP model.
        calibration_ranks: ranks timed per maximum history for the fit.
        seed: seed of the lengths, the IDs and the weights.
    """

    world_sizes: tuple[int, ...] = (8, 64, 256)
    max_histories: tuple[int, ...] = (4096, 8192, 16384, 21504)
    local_batch: int = 128
    steps: int = 3
    rank_runs_per_point: int | None = None
    policies: tuple[str, ...] = POLICIES
    min_gain: float = 0.05
    min_history: int = 3
    embedding_dim: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_negatives: int = 128
    num_items: int = 100_000
    device: str = "cuda"
    tf32: bool = True
    budget_s: float | None = None
    calibrate: bool = True
    calibration_ranks: int = 12
    seed: int = 0
    lengths: LengthDistribution = field(default_factory=LengthDistribution)


class LocalItems(nn.Module):
    """An unsharded item table with the interface SASRec reads from its collection."""

    def __init__(self, table: TableConfig, generator: torch.Generator) -> None:
        super().__init__()
        self.table_configs = (table,)
        bound = table.num_embeddings**-0.5
        weight = torch.rand(table.num_embeddings, table.embedding_dim, generator=generator) * 2 - 1
        self.weight = nn.Parameter(weight * bound)

    def forward(self, batch: JaggedBatch) -> dict[str, JaggedTensor]:
        return {
            name: JaggedTensor(self.weight[feature.values], feature.lengths)
            for name, feature in batch.features.items()
        }


class RankTimer:
    """Times one simulated rank's forward and backward of the real model."""

    def __init__(self, config: ScaleConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        generator = torch.Generator().manual_seed(config.seed)
        model_config = model_config_for(config)
        self.model_config = model_config
        torch.manual_seed(config.seed)
        items = LocalItems(item_tables(model_config)[0], generator)
        self.model = SASRec(model_config, items).to(self.device)  # type: ignore[arg-type]
        self._ids = torch.Generator(device=self.device).manual_seed(config.seed)

    def batch(self, lengths: torch.Tensor) -> JaggedBatch:
        """A batch with these history lengths, uniform item IDs, on the device."""
        config = self.config
        lengths = lengths.to(self.device)
        total = int(lengths.sum())
        draw = lambda n: torch.randint(  # noqa: E731
            0, config.num_items, (n,), device=self.device, generator=self._ids
        )
        negatives = torch.full_like(lengths, config.num_negatives)
        return JaggedBatch(
            features={
                "history": JaggedTensor(draw(total), lengths),
                "negatives": JaggedTensor(draw(lengths.numel() * config.num_negatives), negatives),
            }
        )

    def time(self, lengths: torch.Tensor) -> float:
        """Seconds of one forward and backward of a rank with these histories (sum of losses
        over the rank's targets)."""
        batch = self.batch(lengths)
        self._synchronize()
        started = time.perf_counter()
        losses = self.model(batch)
        losses.sum().backward()
        self._synchronize()
        elapsed = time.perf_counter() - started
        self.model.zero_grad(set_to_none=True)
        return elapsed

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _assignments(
    config: ScaleConfig,
    cost: CostModel,
    lengths: torch.Tensor,
    world_size: int,
    tuner: AlphaAutoTuner,
) -> dict[str, torch.Tensor]:
    costs = cost(lengths)
    local_counts = [config.local_batch] * world_size
    ranks = {}
    for policy in config.policies:
        weights = vbs_weights(lengths, tuner.alpha) if policy == "vbs" else costs
        assignment = partition_or_keep(weights, world_size, policy, local_counts, config.min_gain)  # type: ignore[arg-type]
        ranks[policy] = assignment.ranks
    return ranks


def model_config_for(config: ScaleConfig) -> SASRecConfig:
    """The simulated ranks' SASRec, long enough for the longest history simulated."""
    return SASRecConfig(
        num_items=config.num_items,
        embedding_dim=config.embedding_dim,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        max_length=max(config.max_histories),
    )


def cost_model_for(config: ScaleConfig) -> CostModel:
    """The FLOP cost model ``freescale train`` balances with, for this model."""
    return cost_model(model_config_for(config), config.num_negatives)


def simulate_point(
    config: ScaleConfig,
    timer: RankTimer,
    cost: CostModel,
    tuner: AlphaAutoTuner,
    world_size: int,
    max_history: int,
) -> dict[str, Any]:
    """Every policy's per-rank compute times over ``config.steps`` steps at one point.

    ``tuner`` is VBS's, carried from point to point as over the steps of one run.
    """
    rng = np.random.default_rng([config.seed, world_size, max_history])
    steps: dict[str, list[list[float]]] = {p: [] for p in config.policies}
    reused = 0
    for _ in range(steps_at(config, world_size)):
        lengths = config.lengths.sample(max_history, world_size * config.local_batch, rng)
        lengths = lengths.clamp_min(config.min_history)
        assigned = _assignments(config, cost, lengths, world_size, tuner)
        timed: dict[bytes, float] = {}
        for policy, ranks in assigned.items():
            times = []
            for rank in range(world_size):
                mine = torch.nonzero(ranks == rank).flatten()
                key = mine.numpy().tobytes()
                if key in timed:
                    reused += 1
                elif mine.numel():
                    timed[key] = timer.time(lengths[mine])
                else:
                    timed[key] = 0.0
                times.append(timed[key])
            steps[policy].append(times)
            if policy == "vbs":
                groups = [lengths[ranks == r] for r in range(world_size)]
                tuner.update(groups, torch.tensor(times).clamp_min(1e-9))
    return {
        "world_size": world_size,
        "max_history": max_history,
        "steps": steps_at(config, world_size),
        "reused_rank_times": reused,
        "vbs_alpha": tuner.alpha,
        "policies": {p: summarize_steps(v) for p, v in steps.items()},
        "rank_times_s": steps,
    }


def steps_at(config: ScaleConfig, world_size: int) -> int:
    """Steps simulated at ``world_size`` ranks (``rank_runs_per_point`` bounds them)."""
    if config.rank_runs_per_point is None:
        return config.steps
    fitting = config.rank_runs_per_point // (world_size * len(config.policies))
    return max(1, min(config.steps, fitting))


def summarize_steps(steps: Sequence[Sequence[float]]) -> dict[str, float]:
    """Medians over steps of the slowest rank, the mean rank, straggler % and the bubble."""
    slowest = [max(s) for s in steps]
    mean = [sum(s) / len(s) for s in steps]
    return {
        "step_ms": 1e3 * statistics.median(slowest),
        "mean_rank_ms": 1e3 * statistics.median(mean),
        "straggler_pct": statistics.median(
            100.0 * (m - a) / m if m > 0 else 0.0 for m, a in zip(slowest, mean, strict=True)
        ),
        "bubble_ms": 1e3 * statistics.median(m - a for m, a in zip(slowest, mean, strict=True)),
    }


def against_baseline(point: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per balanced policy: the bubble's reduction (%) and the step's speed-up vs ``none``."""
    policies = point["policies"]
    base = policies["none"]
    return {
        p: {
            "bubble_reduction_pct": 100.0 * (1 - v["bubble_ms"] / base["bubble_ms"])
            if base["bubble_ms"] > 0
            else 0.0,
            "speedup": base["step_ms"] / v["step_ms"] if v["step_ms"] > 0 else 0.0,
        }
        for p, v in policies.items()
        if p != "none"
    }


def calibrate(config: ScaleConfig, timer: RankTimer) -> tuple[CostModel, dict[str, Any]]:
    """A cost model fit to measured rank times, and how well it predicts them.

    Per maximum history, ``calibration_ranks`` ranks: half drawn like the simulation's, half
    the same draw sorted and cut into runs (short to long), so the fit sees a wide range.
    """
    rng = np.random.default_rng([config.seed, 1])
    groups: list[torch.Tensor] = []
    for max_history in config.max_histories:
        half = max(config.calibration_ranks // 2, 1)
        draw = config.lengths.sample(max_history, half * config.local_batch, rng)
        draw = draw.clamp_min(config.min_history)
        groups += list(draw.split(config.local_batch))
        groups += list(draw.sort().values.split(config.local_batch))
    times = torch.tensor([timer.time(g) for g in groups], dtype=torch.float64)
    fitted = CostModel.fit_groups(groups, times)
    return fitted, {
        "cost_model": asdict(fitted),
        "ranks": len(groups),
        "median_relative_error": fitted.relative_error(groups, times),
        "flop_model_relative_error": _scaled_error(cost_model_for(config), groups, times),
    }


def _scaled_error(cost: CostModel, groups: Sequence[torch.Tensor], times: torch.Tensor) -> float:
    """Median relative error of ``cost`` after the best single scale (only ratios balance)."""
    predicted = torch.stack([cost(g).sum() for g in groups])
    scale = float((times / predicted).median())
    return float(((predicted * scale - times).abs() / times).median())


def _warm_up(config: ScaleConfig, timer: RankTimer) -> None:
    """First calls pay for kernels' set-up: a small and a long rank before any timing."""
    longest = max(config.max_histories)
    for length in (min(64, longest), longest):
        timer.time(torch.full((2,), max(length, config.min_history), dtype=torch.int64))


def simulate(config: ScaleConfig, out: Path | None = None) -> dict[str, Any]:
    """Runs every point (cheapest first); writes ``scale.json`` under ``out`` after each."""
    if config.device == "cuda" and config.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    timer = RankTimer(config)
    _warm_up(config, timer)
    flops = cost_model_for(config)
    cost, calibration = calibrate(config, timer) if config.calibrate else (flops, None)
    tuner = AlphaAutoTuner()
    rng = np.random.default_rng(config.seed)

    def rank_cost(max_history: int) -> float:  # expected cost of one rank's batch
        lengths = config.lengths.sample(max_history, 4096, rng).clamp_min(config.min_history)
        return config.local_batch * float(flops(lengths).mean())

    points = sorted(
        ((n, m, rank_cost(m)) for n in config.world_sizes for m in config.max_histories),
        key=lambda p: p[0] * p[2],
    )
    results: dict[str, Any] = {
        "config": _jsonable(config),
        "calibration": calibration,
        "points": [],
        "skipped": [],
    }
    started = time.perf_counter()
    measured: list[tuple[float, float]] = []  # (rank cost, seconds per rank and step)
    for world_size, max_history, per_rank in points:
        runs = world_size * len(config.policies) * steps_at(config, world_size)
        projected = runs * _seconds_per_rank(measured, per_rank)
        if config.budget_s is not None and time.perf_counter() - started + projected > (
            config.budget_s
        ):
            results["skipped"].append({"world_size": world_size, "max_history": max_history})
            continue
        point_started = time.perf_counter()
        point = simulate_point(config, timer, cost, tuner, world_size, max_history)
        point["wall_s"] = time.perf_counter() - point_started
        point["against_baseline"] = against_baseline(point)
        measured.append((per_rank, point["wall_s"] / runs))
        results["points"].append(point)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "scale.json").write_text(json.dumps(results, indent=1) + "\n")
    if config.device == "cuda":
        results["peak_device_mb"] = torch.cuda.max_memory_allocated() / 1e6
    results["wall_s"] = time.perf_counter() - started
    if out is not None:
        (out / "scale.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def _seconds_per_rank(measured: Sequence[tuple[float, float]], rank_cost: float) -> float:
    """A rank's projected seconds: a line through the points so far (one: proportional)."""
    if not measured:
        return 0.0
    costs, seconds = (np.array(v) for v in zip(*measured, strict=True))
    if np.unique(costs).size < 2:
        return float(seconds[-1] / costs[-1] * rank_cost)
    slope, intercept = np.polyfit(costs, seconds, 1)
    return float(max(slope, 0.0) * rank_cost + max(intercept, 0.0))


def _jsonable(config: ScaleConfig) -> dict[str, Any]:
    return asdict(config)


def table(results: dict[str, Any]) -> str:
    """One row per point and policy: step, mean rank, straggler %, bubble, against none."""
    header = (
        f"{'N':>4} {'max hist':>8} {'steps':>5} {'policy':<6} {'step ms':>9} {'mean ms':>9} "
        f"{'straggler %':>11} {'bubble ms':>9} {'bubble -%':>9} {'speed-up':>8}"
    )
    lines = []
    calibration = results.get("calibration")
    if calibration:
        fit = calibration["cost_model"]
        lines.append(
            f"FBS/KK cost model fit to {calibration['ranks']} timed ranks: "
            f"{fit['quadratic']:.3g} L^2 + {fit['linear']:.3g} L + {fit['constant']:.3g} s per "
            f"sample; median error {100 * calibration['median_relative_error']:.1f}% (FLOP "
            f"model, best scale: {100 * calibration['flop_model_relative_error']:.1f}%)"
        )
    lines += [header, "-" * len(header)]
    for point in results["points"]:
        versus = point["against_baseline"]
        for policy, v in point["policies"].items():
            reduction = versus.get(policy, {}).get("bubble_reduction_pct")
            speedup = versus.get(policy, {}).get("speedup")
            lines.append(
                f"{point['world_size']:>4} {point['max_history']:>8} {point['steps']:>5} "
                f"{policy:<6} "
                f"{v['step_ms']:>9.1f} {v['mean_rank_ms']:>9.1f} {v['straggler_pct']:>11.1f} "
                f"{v['bubble_ms']:>9.1f} "
                + (f"{reduction:>9.1f} {speedup:>8.2f}" if reduction is not None else "")
            )
    for skipped in results["skipped"]:
        lines.append(f"skipped (budget): N={skipped['world_size']} M={skipped['max_history']}")
    return "\n".join(lines)
