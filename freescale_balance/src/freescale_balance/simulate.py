"""Straggler simulation: how much of each step the slowest rank keeps the others waiting.

For each world size and maximum UIH length, draw global batches from a heavy-tailed length
distribution, partition them with every policy, and compute the straggler fraction
``(max - mean) / max`` of per-rank cost under the cost model. VBS tunes its exponent from the
simulated per-rank times, step after step, as it would from measured ones.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from freescale_balance.autotune import AlphaAutoTuneConfig, AlphaAutoTuner
from freescale_balance.cost_model import CostModel
from freescale_balance.partition import POLICIES, partition, straggler_fraction, vbs_weights


@dataclass(frozen=True)
class LengthDistribution:
    """UIH lengths: log-normal, capped at the maximum UIH length.

    The default median is ``max_uih * median_fraction``, calibrated so that unbalanced training
    shows 20–30% straggler beyond 8K on 64–256 ranks (the seed paper's measurement); set
    ``median`` for a fixed history distribution that the cap truncates instead.
    """

    sigma: float = 0.75
    median_fraction: float = 1 / 8
    median: float | None = None

    def sample(self, max_uih: int, count: int, rng: np.random.Generator) -> torch.Tensor:
        median = self.median if self.median is not None else max_uih * self.median_fraction
        lengths = np.round(rng.lognormal(np.log(median), self.sigma, count))
        return torch.from_numpy(np.clip(lengths, 1, max_uih).astype(np.int64))


@dataclass(frozen=True)
class SimulationConfig:
    """What ``freescale balance simulate`` sweeps.

    Attributes:
        world_sizes: ranks of each simulated cluster.
        max_uih: caps of the UIH (user interaction history) length, one sweep point each.
        local_batch: samples per rank and step.
        steps: global batches per point; the first ``warmup_steps`` only tune VBS's exponent.
        warmup_steps: steps left out of the median (VBS's exponent settles first).
        seed: seed of the length draws.
        distribution: the UIH length distribution.
        cost_model: per-sample cost from its length.
        autotune: VBS's exponent tuner.
        timing_world_size: world size of the partition timing.
        timing_repeats: timed calls per policy (the median is reported).
    """

    world_sizes: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    max_uih: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 21504, 32768)
    local_batch: int = 128
    steps: int = 8
    warmup_steps: int = 3
    seed: int = 0
    distribution: LengthDistribution = field(default_factory=LengthDistribution)
    cost_model: CostModel = field(default_factory=CostModel)
    autotune: AlphaAutoTuneConfig = field(default_factory=AlphaAutoTuneConfig)
    timing_world_size: int = 256
    timing_repeats: int = 30

    def __post_init__(self) -> None:
        if self.steps <= self.warmup_steps:
            raise ValueError(
                f"steps ({self.steps}) must exceed warmup_steps ({self.warmup_steps}): "
                "the warm-up steps are not measured"
            )
        if min(self.world_sizes, default=0) < 1 or min(self.max_uih, default=0) < 1:
            raise ValueError("world_sizes and max_uih need at least one value, each >= 1")
        if self.local_batch < 1 or self.warmup_steps < 0 or self.timing_repeats < 1:
            raise ValueError("local_batch and timing_repeats must be >= 1, warmup_steps >= 0")


def _simulate_point(config: SimulationConfig, world_size: int, max_uih: int) -> dict:
    rng = np.random.default_rng([config.seed, world_size, max_uih])
    tuner = AlphaAutoTuner(config.autotune)
    straggler: dict[str, list[float]] = {p: [] for p in POLICIES}
    for step in range(config.steps):
        lengths = config.distribution.sample(max_uih, world_size * config.local_batch, rng)
        costs = config.cost_model(lengths)
        for policy in POLICIES:
            weights = vbs_weights(lengths, tuner.alpha) if policy == "vbs" else costs
            assignment = partition(weights, world_size, policy)
            loads = assignment.loads(costs)
            if step >= config.warmup_steps:
                straggler[policy].append(straggler_fraction(loads))
            if policy == "vbs":
                groups = [lengths[assignment.ranks == r] for r in range(world_size)]
                tuner.update(groups, loads)
    return {
        "world_size": world_size,
        "max_uih": max_uih,
        "straggler_pct": {p: 100 * statistics.median(v) for p, v in straggler.items()},
        "vbs_alpha": tuner.alpha,
    }


def time_partitions(config: SimulationConfig) -> dict[str, float]:
    """Median wall time (ms) of each policy on one global batch of the timing world size."""
    world_size = config.timing_world_size
    rng = np.random.default_rng(config.seed)
    lengths = config.distribution.sample(max(config.max_uih), world_size * config.local_batch, rng)
    costs = config.cost_model(lengths)
    result = {}
    for policy in POLICIES:
        weights = vbs_weights(lengths, config.autotune.initial_alpha) if policy == "vbs" else costs
        partition(weights, world_size, policy)  # warm-up
        times = []
        for _ in range(config.timing_repeats):
            start = time.perf_counter()
            partition(weights, world_size, policy)
            times.append(time.perf_counter() - start)
        result[policy] = 1e3 * statistics.median(times)
    return result


def simulate(config: SimulationConfig, progress: bool = False) -> dict:
    """Runs the sweep; returns a JSON-ready report.

    Args:
        config: what to sweep.
        progress: show a progress bar on stderr, one tick per (world size, max UIH) point.
    """
    grid = [(w, m) for w in config.world_sizes for m in config.max_uih]
    bar = tqdm(grid, desc="simulate", unit="point", disable=not progress, leave=False)
    points = [_simulate_point(config, world_size, max_uih) for world_size, max_uih in bar]
    return {
        "config": asdict(config),
        "points": points,
        "partition_ms": time_partitions(config),
        "partition_samples": config.timing_world_size * config.local_batch,
    }


def format_table(report: dict) -> str:
    header = f"{'world':>5} {'max UIH':>8} " + " ".join(f"{p + ' %':>8}" for p in POLICIES)
    lines = ["straggler % = (max - mean) / max of per-rank cost (median over steps)", header]
    for point in report["points"]:
        values = " ".join(f"{point['straggler_pct'][p]:8.2f}" for p in POLICIES)
        lines.append(f"{point['world_size']:>5} {point['max_uih']:>8} {values}")
    timing = " ".join(f"{p} {ms:.2f} ms" for p, ms in report["partition_ms"].items())
    lines.append(f"partition time for {report['partition_samples']} samples: {timing}")
    return "\n".join(lines)


def headline(report: dict, world_size: int = 256, max_uih: int = 21504) -> str | None:
    """The paper's comparison point: FBS vs none (and KK vs FBS) at 21K on 256 ranks."""
    for point in report["points"]:
        if point["world_size"] == world_size and point["max_uih"] == max_uih:
            s = point["straggler_pct"]
            ratio = s["none"] / max(s["fbs"], 1e-9)
            return (
                f"at max UIH {max_uih} on {world_size} ranks: none {s['none']:.2f}%, "
                f"FBS {s['fbs']:.2f}% ({ratio:.1f}x lower), KK {s['kk']:.2f}%, VBS {s['vbs']:.2f}%"
            )
    return None


def plot(report: dict, path: Path) -> bool:
    """Writes straggler % vs max UIH, one panel per world size; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    world_sizes = sorted({p["world_size"] for p in report["points"]})
    columns = min(3, len(world_sizes))
    rows = -(-len(world_sizes) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.5 * columns, 3.5 * rows), squeeze=False)
    for ax, world_size in zip(axes.flat, world_sizes, strict=False):
        points = [p for p in report["points"] if p["world_size"] == world_size]
        for policy in POLICIES:
            ax.plot(
                [p["max_uih"] for p in points],
                [max(p["straggler_pct"][policy], 1e-3) for p in points],
                marker="o",
                label=policy,
            )
        ax.set(xscale="log", yscale="log", title=f"{world_size} ranks", xlabel="max UIH")
        ax.set_ylabel("straggler % (0 drawn at 0.001)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes.flat[len(world_sizes) :]:
        ax.axis("off")
    axes.flat[0].legend()
    figure.suptitle("Straggler % by partition policy (lower is better)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def write_report(report: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "straggler.json"]
    written[0].write_text(json.dumps(report, indent=2))
    if plot(report, out_dir / "straggler.png"):
        written.append(out_dir / "straggler.png")
    return written
