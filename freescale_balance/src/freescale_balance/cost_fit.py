"""The FBS/KK cost model fit online to measured per-rank compute times.

Each observed step gives one row per rank: ``[sum L^2, sum L, samples]`` of the samples that rank
computed, and its measured compute time. After a warm-up, the model ``a*L^2 + b*L + c`` is the
non-negative least-squares fit over a window of recent rows. Every rank observes the same
(gathered) times, and the fit runs in plain Python floats in a fixed order, so every rank gets
the same coefficients to the bit whatever its BLAS: the ranks keep partitioning alike.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from freescale_balance.cost_model import CostModel

Row = tuple[float, float, float]
# Non-empty subsets of the three coefficients, the full model first: NNLS over three unknowns
# is the feasible restricted least-squares fit with the smallest residual.
_SUPPORTS = [s for k in (3, 2, 1) for s in itertools.combinations(range(3), k)]


@dataclass(frozen=True)
class CostFitConfig:
    """Settings of the online fit (``BalancerConfig.fit``).

    Attributes:
        warmup_steps: observed steps ignored first (they pay for start-up and caches).
        min_steps: steps observed after the warm-up before the fit replaces the configured model.
        window_steps: the fit uses this many most recent steps.
    """

    warmup_steps: int = 3
    min_steps: int = 3
    window_steps: int = 64

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.min_steps < 1 or self.window_steps < self.min_steps:
            raise ValueError(
                "need warmup_steps >= 0, min_steps >= 1 and window_steps >= min_steps, got "
                f"{self.warmup_steps}, {self.min_steps}, {self.window_steps}"
            )


def group_rows(lengths: torch.Tensor, ranks: torch.Tensor, world_size: int) -> list[Row]:
    """``[sum L^2, sum L, count]`` of each rank's samples (``ranks``: each sample's rank)."""
    length = lengths.to(torch.float64)
    features = torch.stack([length * length, length, torch.ones_like(length)], dim=1)
    sums = torch.zeros(world_size, 3, dtype=torch.float64).index_add_(0, ranks, features)
    return [(float(a), float(b), float(c)) for a, b, c in sums.tolist()]


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; ``None`` if (numerically) singular."""
    n = len(vector)
    a = [[*row, v] for row, v in zip(matrix, vector, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            factor = a[r][col] / a[col][col]
            for c in range(col, n + 1):
                a[r][c] -= factor * a[col][c]
    solution = [0.0] * n
    for r in reversed(range(n)):
        rest = sum(a[r][c] * solution[c] for c in range(r + 1, n))
        solution[r] = (a[r][n] - rest) / a[r][r]
    return solution


def fit_rows(rows: Sequence[Row], times: Sequence[float]) -> CostModel | None:
    """Non-negative least squares of ``times ~ rows @ [a, b, c]``, bit-identical on every
    machine (plain Python floats, fixed order). ``None`` when no support is solvable."""
    if len(rows) != len(times):
        raise ValueError(f"{len(rows)} rows but {len(times)} times")
    # Columns scaled to at most 1, so the normal equations of L^2 and of 1 are comparable.
    scale = [max(abs(row[k]) for row in rows) or 1.0 for k in range(3)]
    scaled = [[row[k] / scale[k] for k in range(3)] for row in rows]
    best: tuple[float, list[float]] | None = None
    for support in _SUPPORTS:
        gram = [[sum(x[i] * x[j] for x in scaled) for j in support] for i in support]
        moment = [sum(x[i] * t for x, t in zip(scaled, times, strict=True)) for i in support]
        solution = _solve(gram, moment)
        if solution is None or any(s < 0 for s in solution):
            continue
        full = [0.0, 0.0, 0.0]
        for k, s in zip(support, solution, strict=True):
            full[k] = s
        residual = sum(
            (t - sum(x[k] * full[k] for k in range(3))) ** 2
            for x, t in zip(scaled, times, strict=True)
        )
        if best is None or residual < best[0]:
            best = (residual, full)
    if best is None or not any(best[1]):
        return None
    a, b, c = (best[1][k] / scale[k] for k in range(3))
    return CostModel(quadratic=a, linear=b, constant=c)


class OnlineCostFit:
    """Collects per-rank (lengths, compute time) rows and refits the cost model.

    Args:
        config: warm-up and window.
        initial: the model used until the fit has enough rows.
    """

    def __init__(self, config: CostFitConfig, initial: CostModel) -> None:
        self.config = config
        self.model = initial
        self.fitted = False
        self._seen = 0
        self._steps: deque[tuple[list[Row], list[float]]] = deque(maxlen=config.window_steps)

    def observe(self, rows: list[Row], times: Sequence[float]) -> CostModel:
        """Adds one step (a row and a time per rank); returns the model to use from now on."""
        self._seen += 1
        if self._seen <= self.config.warmup_steps:
            return self.model
        self._steps.append((rows, [float(t) for t in times]))
        if len(self._steps) < self.config.min_steps:
            return self.model
        fitted = fit_rows(
            [r for rows_, _ in self._steps for r in rows_],
            [t for _, times_ in self._steps for t in times_],
        )
        if fitted is not None:
            self.model, self.fitted = fitted, True
        return self.model
