"""Cost model fits and VBS exponent AutoTune (pure logic)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freescale_balance import AlphaAutoTuneConfig, AlphaAutoTuner, CostModel, partition
from freescale_balance.partition import vbs_weights


def test_fit_recovers_coefficients_from_noisy_per_sample_times():
    rng = np.random.default_rng(1)
    lengths = torch.from_numpy(rng.integers(1, 16384, 2000))
    truth = CostModel(2e-6, 5e-3, 40.0)
    times = truth(lengths) * torch.from_numpy(rng.normal(1, 0.01, 2000))
    fitted = CostModel.fit(lengths, times)
    assert fitted.quadratic == pytest.approx(truth.quadratic, rel=0.03)
    assert fitted.linear == pytest.approx(truth.linear, rel=0.05)


def test_fit_groups_uses_sums_and_keeps_coefficients_non_negative():
    rng = np.random.default_rng(2)
    groups = [torch.from_numpy(rng.integers(1, 8192, rng.integers(1, 64))) for _ in range(50)]
    truth = CostModel(1e-6, 0.0, 10.0)
    times = torch.stack([truth(g).sum() for g in groups])
    fitted = CostModel.fit_groups(groups, times)
    assert min(fitted.quadratic, fitted.linear, fitted.constant) >= 0
    assert fitted.relative_error(groups, times) < 1e-6
    with pytest.raises(ValueError, match="groups"):
        CostModel.fit_groups(groups[:3], times)


@pytest.mark.parametrize("true_alpha", [1.3, 1.8, 2.2])
def test_autotune_moves_alpha_to_the_exponent_the_times_follow(true_alpha):
    rng = np.random.default_rng(3)
    tuner = AlphaAutoTuner(AlphaAutoTuneConfig(initial_alpha=1.0))
    world = 16
    for _ in range(12):
        lengths = torch.from_numpy(np.round(rng.lognormal(6, 1.0, world * 64)).clip(1, 8192))
        assigned = partition(vbs_weights(lengths, tuner.alpha), world, "vbs")
        groups = [lengths[assigned.ranks == r] for r in range(world)]
        times = torch.stack([g.to(torch.float64).pow(true_alpha).sum() for g in groups])
        tuner.update(groups, times * torch.from_numpy(rng.normal(1, 0.01, world)))
    assert tuner.alpha == pytest.approx(true_alpha, abs=0.1)
