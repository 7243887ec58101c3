"""A compute kernel's slowdown beside traffic: the one method of ``comm_gpu.py`` and ``multi_gpu``.

GPU clocks drift by several percent over seconds under a matmul load (/work/shared/GPU.md), so
medians of modes measured at different times are not comparable. Each round therefore runs every
mode once, in an order drawn anew every round (the same on every rank: one seed), and puts each
mode's window between two windows of the compute alone; a mode's figure is the median over rounds
of its window's time over the mean of its two neighbours. The ``control`` mode runs nothing
beside the compute, as ``alone`` does: its figure is the method's own noise, reported beside the
others. What a window is (which kernel, how it is timed, what traffic runs beside it) is the
caller's.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

ALONE = "alone"
CONTROL = "control"


class ModeDropped(Exception):
    """Raised by a window on every rank alike: its mode failed and leaves the later rounds."""


@dataclass
class Rounds:
    """What the rounds measured on this rank.

    Attributes:
        ratios: mode -> per round, its window's time over the mean of its two ``alone``
            neighbours (empty on a rank whose windows time nothing).
        alone_ms: every ``alone`` window after the first of each round.
        dropped: modes whose window raised ``ModeDropped``, in that order.
    """

    ratios: dict[str, list[float]]
    alone_ms: list[float] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def slowdown_pct(self) -> dict[str, float]:
        """Mode -> median slowdown in percent (the modes this rank timed)."""
        return {m: 100 * (statistics.median(v) - 1) for m, v in self.ratios.items() if v}

    def slowdown_pct_range(self) -> dict[str, list[float]]:
        """Mode -> [lowest, highest] slowdown over the rounds, in percent."""
        return {m: [100 * (min(v) - 1), 100 * (max(v) - 1)] for m, v in self.ratios.items() if v}


def windows_per_round(modes: int) -> int:
    """Windows one round runs for ``modes`` traffic modes (``control`` and ``alone`` added)."""
    return 1 + 2 * (modes + 1)


def alternated_rounds(
    window: Callable[[str], float | None], modes: Sequence[str], rounds: int, seed: int
) -> Rounds:
    """Runs ``rounds`` rounds of ``modes`` plus ``control``, each between ``alone`` windows.

    Args:
        window: runs one window of ``mode`` (``ALONE`` and ``CONTROL``: the compute alone) on
            this rank and returns its time in ms, or ``None`` where this rank times nothing. It
            raises ``ModeDropped`` (on every rank alike) when the mode failed.
        modes: the traffic modes, called in the same order on every rank.
        rounds: how many rounds.
        seed: seeds each round's order; the same on every rank.
    """
    active = [*modes, CONTROL]
    result = Rounds(ratios={m: [] for m in active})
    shuffle = random.Random(seed)
    for _ in range(rounds):
        # A new order every round: a mode that leaves the GPU hot must not always precede the
        # same other mode.
        order = shuffle.sample(active, len(active))
        before = window(ALONE)
        for mode in order:
            if mode not in active:
                continue  # dropped earlier in this round
            try:
                during = window(mode)
            except ModeDropped:
                active.remove(mode)
                result.dropped.append(mode)
                continue
            after = window(ALONE)
            if after is not None:
                result.alone_ms.append(after)
            if during is not None and before is not None and after is not None:
                result.ratios[mode].append(during / ((before + after) / 2))
            before = after
    return result
