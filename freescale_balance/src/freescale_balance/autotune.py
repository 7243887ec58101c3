"""AutoTune of the VBS exponent from measured per-rank step times.

VBS cuts the batch so every rank gets the same sum of ``L^alpha``. If the true cost grows as
``L^alpha*`` and ``alpha != alpha*``, ranks that got the long sequences run slower (alpha too
small) or faster (alpha too large) than the rest. AutoTune keeps a window of recent steps (each
rank's sample lengths and measured time), finds the exponent under which the measured times are
best explained as proportional to ``sum L^alpha``, and moves alpha towards it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AlphaAutoTuneConfig:
    """Settings of ``AlphaAutoTuner``.

    Attributes:
        initial_alpha: exponent before any measurement.
        min_alpha, max_alpha: range searched.
        grid_points: candidate exponents tried in that range.
        window: number of recent steps the fit uses.
        step_size: fraction of the way alpha moves towards the best fit each update (damping).
    """

    initial_alpha: float = 1.5
    min_alpha: float = 1.0
    max_alpha: float = 2.5
    grid_points: int = 61
    window: int = 16
    step_size: float = 0.5


class AlphaAutoTuner:
    """Adjusts the VBS exponent from per-rank measured times, step after step."""

    def __init__(self, config: AlphaAutoTuneConfig | None = None) -> None:
        self.config = config or AlphaAutoTuneConfig()
        self.alpha = self.config.initial_alpha
        self._history: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=self.config.window)

    def state_dict(self) -> dict[str, object]:
        """The exponent and the window of measured steps (for checkpoints)."""
        return {"alpha": self.alpha, "history": [(p.copy(), t.copy()) for p, t in self._history]}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.alpha = float(state["alpha"])  # type: ignore[arg-type]
        self._history.clear()
        self._history.extend(state["history"])  # type: ignore[arg-type]

    @property
    def grid(self) -> np.ndarray:
        config = self.config
        return np.linspace(config.min_alpha, config.max_alpha, config.grid_points)

    def best_alpha(self) -> float:
        """The exponent that best explains the window's times as proportional to ``sum L^alpha``.

        Each step's times are compared to their own best scale, so a step that was slower overall
        (other load, clocks) does not bias the fit; the error is relative per rank.
        """
        errors = np.zeros(self.config.grid_points)
        for predicted, times in self._history:
            ratio = predicted / times[None, :]
            scale = np.median(ratio, axis=1, keepdims=True)
            errors += ((ratio / scale - 1.0) ** 2).mean(axis=1)
        return float(self.grid[int(np.argmin(errors))])

    def update(self, rank_lengths: Sequence[torch.Tensor], rank_times: torch.Tensor) -> float:
        """Records one step (each rank's sample lengths and time); returns the new alpha."""
        times = rank_times.detach().to("cpu", torch.float64).numpy()
        if len(rank_lengths) != times.size:
            raise ValueError(f"{len(rank_lengths)} ranks of lengths but {times.size} times")
        if not (times > 0).all():
            raise ValueError("measured times must be positive")
        counts = np.array([g.numel() for g in rank_lengths])
        lengths = torch.cat([g.flatten() for g in rank_lengths]).to(torch.float64).numpy()
        # [grid, samples] -> per-rank sums [grid, ranks], computed once per step.
        powers = np.power(np.maximum(lengths, 0)[None, :], self.grid[:, None])
        prefix = np.concatenate([np.zeros((powers.shape[0], 1)), powers.cumsum(axis=1)], axis=1)
        bounds = np.concatenate(([0], counts.cumsum()))
        self._history.append((prefix[:, bounds[1:]] - prefix[:, bounds[:-1]], times))
        target = self.best_alpha()
        self.alpha += self.config.step_size * (target - self.alpha)
        return self.alpha
