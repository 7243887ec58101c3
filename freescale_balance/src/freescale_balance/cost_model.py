"""Expected dense compute time of a sample from its sequence length.

A transformer-style layer over a sequence of length L spends ``~L^2`` in attention and ``~L`` in
projections and MLPs, plus a fixed per-sample overhead, so time ~ ``a*L^2 + b*L + c``. FBS and KK
balance these costs; VBS keeps its own ``L^alpha`` weights (see ``autotune``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class CostModel:
    """Per-sample cost ``quadratic * L^2 + linear * L + constant`` (any consistent time unit).

    The default weighs attention against the linear layers of a model of width 512
    (attention FLOPs ~ 4*L^2*d, projections + MLP ~ 24*L*d^2: equal at L = 6d = 3072).
    """

    quadratic: float = 1.0
    linear: float = 3072.0
    constant: float = 0.0

    def __call__(self, lengths: torch.Tensor) -> torch.Tensor:
        """Cost of each sample, float64, same shape as ``lengths``."""
        length = lengths.to(torch.float64)
        return (self.quadratic * length + self.linear) * length + self.constant

    @staticmethod
    def _features(lengths: torch.Tensor) -> np.ndarray:
        length = lengths.detach().to("cpu", torch.float64).numpy()
        return np.stack([length * length, length, np.ones_like(length)], axis=-1)

    @classmethod
    def fit(cls, lengths: torch.Tensor, times: torch.Tensor) -> CostModel:
        """Least-squares fit with non-negative coefficients from per-sample (length, time) pairs."""
        features = cls._features(lengths.flatten())
        return cls._solve(features, times)

    @classmethod
    def fit_groups(cls, groups: Sequence[torch.Tensor], times: torch.Tensor) -> CostModel:
        """Fit from the measured time of whole groups of samples (e.g. one rank's micro-batch).

        A group's predicted time is the sum of its samples' costs, so each group contributes one
        row ``[sum L^2, sum L, count]``.
        """
        if len(groups) != times.numel():
            raise ValueError(f"{len(groups)} groups but {times.numel()} times")
        features = np.stack([cls._features(g.flatten()).sum(axis=0) for g in groups])
        return cls._solve(features, times)

    @classmethod
    def _solve(cls, features: np.ndarray, times: torch.Tensor) -> CostModel:
        target = times.detach().to("cpu", torch.float64).numpy().reshape(-1)
        if features.shape[0] != target.size:
            raise ValueError(f"{features.shape[0]} samples but {target.size} times")
        if target.size < 3:
            raise ValueError("fitting three coefficients needs at least three measurements")
        # Active-set NNLS over three unknowns: drop negative coefficients and refit the rest.
        active = [0, 1, 2]
        coefficients = np.zeros(3)
        while active:
            scale = np.abs(features[:, active]).max(axis=0)
            scale[scale == 0] = 1
            solution, *_ = np.linalg.lstsq(features[:, active] / scale, target, rcond=None)
            solution = solution / scale
            if (solution >= 0).all():
                coefficients[:] = 0
                coefficients[active] = solution
                break
            active = [a for a, s in zip(active, solution, strict=True) if s >= 0]
        return cls(*(float(c) for c in coefficients))

    def relative_error(self, lengths_groups: Sequence[torch.Tensor], times: torch.Tensor) -> float:
        """Median of ``|predicted - measured| / measured`` over groups."""
        predicted = torch.stack([self(g).sum() for g in lengths_groups])
        measured = times.to(torch.float64)
        return float(((predicted - measured).abs() / measured).median())
