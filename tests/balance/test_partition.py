"""Partitioners: every sample exactly once, counts, contiguity, determinism (pure logic)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale_balance import CostModel, partition, straggler_fraction
from freescale_balance.partition import argsort_descending

costs_and_world = st.integers(1, 40).flatmap(
    lambda world: st.tuples(
        st.lists(
            st.one_of(st.integers(0, 5), st.integers(0, 10**6)).map(float),
            min_size=0,
            max_size=300,
        ),
        st.just(world),
    )
)


def _check_assignment(costs: list[float], world: int, policy: str) -> torch.Tensor:
    ranks = partition(torch.tensor(costs, dtype=torch.float64), world, policy).ranks
    assert ranks.dtype == torch.int64 and ranks.shape == (len(costs),)
    assert bool(((ranks >= 0) & (ranks < world)).all())
    return ranks


@settings(max_examples=150, deadline=None)
@given(costs_and_world, st.sampled_from(["fbs", "kk"]))
def test_equal_count_policies_place_every_sample_once_with_balanced_counts(case, policy):
    costs, world = case
    ranks = _check_assignment(costs, world, policy)
    counts = torch.bincount(ranks, minlength=world)
    assert int(counts.sum()) == len(costs)
    assert int(counts.max() - counts.min()) <= 1
    if len(costs) % world == 0:
        assert bool((counts == len(costs) // world).all())


@settings(max_examples=150, deadline=None)
@given(costs_and_world)
def test_vbs_cuts_contiguous_runs_of_the_original_order(case):
    costs, world = case
    ranks = _check_assignment(costs, world, "vbs")
    assert bool((ranks[1:] >= ranks[:-1]).all())
    total = sum(costs)
    if total > 0 and len(costs) >= world:
        loads = torch.zeros(world, dtype=torch.float64).index_add_(
            0, ranks, torch.tensor(costs, dtype=torch.float64)
        )
        # A cut never misses its equal share by more than the largest single sample.
        assert float(loads.max()) <= total / world + max(costs) + 1e-6


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 8).map(float), min_size=0, max_size=500))
def test_descending_sort_breaks_ties_by_index(values):
    array = np.array(values, dtype=np.float64)
    expected = np.argsort(-array, kind="stable")
    assert np.array_equal(argsort_descending(array), expected)


def test_order_within_a_rank_is_the_original_order():
    costs = torch.rand(1000, dtype=torch.float64)
    for policy in ("fbs", "vbs", "kk"):
        assigned = partition(costs, 7, policy)
        for rank in range(7):
            indices = assigned.samples_of(rank)
            assert bool((indices[1:] > indices[:-1]).all())


def test_none_keeps_samples_on_their_source_rank_even_with_uneven_batches():
    ranks = partition(torch.ones(6), 3, "none", local_counts=[1, 0, 5]).ranks
    assert ranks.tolist() == [0, 2, 2, 2, 2, 2]
    with pytest.raises(ValueError, match="do not split evenly"):
        partition(torch.ones(5), 2, "none")


@pytest.mark.parametrize(
    "costs, world, message",
    [
        (torch.tensor([1.0, -1.0]), 2, "non-negative"),
        (torch.tensor([1.0, float("nan")]), 2, "finite"),
        (torch.ones(2, 2), 2, "1-D"),
        (torch.ones(4), 0, "positive"),
    ],
)
def test_bad_costs_are_refused(costs, world, message):
    with pytest.raises(ValueError, match=message):
        partition(costs, world, "fbs")
    with pytest.raises(ValueError, match="unknown partition policy"):
        partition(torch.ones(4), 2, "round-robin")


def test_kk_is_no_worse_than_fbs_and_both_beat_none_on_skewed_batches():
    rng = np.random.default_rng(0)
    model = CostModel()
    results = {"none": [], "fbs": [], "kk": []}
    for _ in range(20):
        lengths = torch.from_numpy(np.round(rng.lognormal(7.6, 0.75, 32 * 128)).clip(1, 16384))
        costs = model(lengths)
        for policy in results:
            results[policy].append(straggler_fraction(partition(costs, 32, policy).loads(costs)))
    median = {p: float(np.median(v)) for p, v in results.items()}
    assert median["kk"] <= median["fbs"] < median["none"] / 5


def test_kk_follows_largest_differencing_on_a_hand_worked_instance():
    # Groups by cost: (8, 7), (6, 5), (4, 0); spreads 1, 1, 4. Merge the widest, (4, 0), with
    # (8, 7) heaviest-to-lightest: (4+7, 0+8) = (11, 8); then with (6, 5): (11+5, 8+6) = (16, 14).
    costs = torch.tensor([8.0, 7.0, 6.0, 5.0, 4.0, 0.0])
    loads = sorted(partition(costs, 2, "kk").loads(costs).tolist())
    assert loads == [14.0, 16.0]
