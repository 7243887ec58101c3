"""The online cost-model fit (pure logic): least squares, non-negativity, warm-up and window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freescale_balance import CostFitConfig, CostModel, OnlineCostFit
from freescale_balance.cost_fit import fit_rows, group_rows


def _rows(seed: int, count: int) -> list[tuple[float, float, float]]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        lengths = torch.from_numpy(rng.integers(1, 4096, rng.integers(1, 16)))
        rows.extend(group_rows(lengths, torch.zeros(lengths.numel(), dtype=torch.int64), 1))
    return rows


def _time(model: CostModel, row: tuple[float, float, float]) -> float:
    return model.quadratic * row[0] + model.linear * row[1] + model.constant * row[2]


def test_group_rows_sum_each_ranks_squares_lengths_and_count():
    rows = group_rows(torch.tensor([3, 1, 2, 4]), torch.tensor([1, 0, 1, 1]), 3)
    assert rows == [(1.0, 1.0, 1.0), (29.0, 9.0, 3.0), (0.0, 0.0, 0.0)]


def test_fit_recovers_the_model_of_noiseless_rank_times():
    truth = CostModel(8e-12, 6e-8, 1.5e-4)
    rows = _rows(0, 40)
    fitted = fit_rows(rows, [_time(truth, r) for r in rows])
    assert fitted.quadratic == pytest.approx(truth.quadratic, rel=1e-6)
    assert fitted.linear == pytest.approx(truth.linear, rel=1e-6)
    assert fitted.constant == pytest.approx(truth.constant, rel=1e-6)


def test_fit_keeps_coefficients_non_negative_and_matches_numpy_nnls():
    # Times that fall with L^2: unconstrained least squares would give a negative a.
    rows = _rows(1, 30)
    rng = np.random.default_rng(3)
    times = [1e-3 * r[2] + 1e-6 * r[1] - 1e-12 * r[0] + 1e-5 * rng.random() for r in rows]
    fitted = fit_rows(rows, times)
    assert fitted is not None and min(fitted.quadratic, fitted.linear, fitted.constant) >= 0
    assert fitted.quadratic == 0.0
    # The same as the active-set solver of CostModel (numpy) to rounding.
    reference = CostModel._solve(np.array(rows), torch.tensor(times))
    for got, want in zip(
        (fitted.quadratic, fitted.linear, fitted.constant),
        (reference.quadratic, reference.linear, reference.constant),
        strict=True,
    ):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-15)


def test_online_fit_waits_for_the_warm_up_then_fits_over_its_window():
    initial = CostModel(1.0, 3072.0, 0.0)
    first, second = CostModel(1e-9, 1e-6, 1e-3), CostModel(2e-9, 0.0, 5e-3)
    online = OnlineCostFit(CostFitConfig(warmup_steps=2, min_steps=2, window_steps=3), initial)
    steps = [_rows(seed, 4) for seed in range(10)]
    # Warm-up steps (wildly wrong times) are dropped; the fit waits for min_steps after them.
    assert online.observe(steps[0], [9.0] * 4) == initial
    assert online.observe(steps[1], [9.0] * 4) == initial
    assert online.observe(steps[2], [_time(first, r) for r in steps[2]]) == initial
    model = online.observe(steps[3], [_time(first, r) for r in steps[3]])
    assert online.fitted and model.quadratic == pytest.approx(first.quadratic, rel=1e-6)
    # After window_steps of another model, only that one remains in the fit.
    for rows in steps[4:7]:
        model = online.observe(rows, [_time(second, r) for r in rows])
    assert model.constant == pytest.approx(second.constant, rel=1e-6)
    assert model.linear == pytest.approx(0.0, abs=1e-12)


def test_no_solvable_fit_keeps_the_configured_model():
    initial = CostModel()
    online = OnlineCostFit(CostFitConfig(warmup_steps=0, min_steps=1), initial)
    assert online.observe([(0.0, 0.0, 0.0)] * 2, [0.0, 0.0]) == initial and not online.fitted


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="window_steps >= min_steps"):
        CostFitConfig(min_steps=4, window_steps=2)
