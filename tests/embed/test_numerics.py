"""Prioritized mode is bitwise synchronous training; sync mode is the dense reference.

Real ranks over Gloo, 50 steps per run. Each case trains a sync and a prioritized collection on
the same batches in the same processes and requires ``torch.equal`` of every output of every
step, of the final tables and of the optimizer state; the sync run must also match a dense
float64 single-process reference of the global batch to float32 rounding.
"""

from __future__ import annotations

import pytest

from freescale_embed import SGD, Adam, RowWiseAdagrad
from tests.embed import ranks

OPTIMIZERS = {"sgd": SGD(lr=0.1), "rowwise_adagrad": RowWiseAdagrad(lr=0.1)}
# Exact collision rates of consecutive steps, and plain Zipf IDs over the whole table (None),
# whose hot rows collide in every step.
RATES = [0.0, 0.05, 0.2, 0.5, None]


@pytest.mark.parametrize("rate", RATES, ids=lambda r: "zipf" if r is None else f"{r:.0%}")
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS), ids=str)
@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"{w}ranks")
def test_prioritized_is_bitwise_sync_and_sync_is_the_reference(
    local_groups, world, optimizer, rate
):
    case = ranks.Case(optimizer=OPTIMIZERS[optimizer], collision_rate=rate)
    results = local_groups.get(world).run(ranks.modes_agree, case, timeout_s=240)
    collisions = results[0]["collision_pct"][1:]
    assert results[0]["lookup"][0] == "sync"  # the first step has nothing prefetched
    assert set(results[0]["lookup"][1:]) == {"prefetched"}
    if rate == 0.0:
        assert max(collisions) == 0.0
    elif rate is not None:
        # Every table shares exactly `rate` of its rows; the 3-row table rounds differently.
        assert min(collisions) >= 100 * rate - 2 and max(collisions) <= 100 * rate + 8


@pytest.mark.parametrize("rate", [0.05, None], ids=["5%", "zipf"])
def test_adam_with_a_changing_learning_rate(local_groups, rate):
    case = ranks.Case(optimizer=Adam(lr=0.02), collision_rate=rate, lr_decay=0.9)
    local_groups.get(2).run(ranks.modes_agree, case, timeout_s=240)


def test_learning_rate_changes_reach_deferred_updates(local_groups):
    # The rest of step t's gradients is applied during step t+1, after the caller has set t+1's
    # learning rate: it must still use step t's.
    case = ranks.Case(optimizer=RowWiseAdagrad(lr=0.3), collision_rate=0.2, lr_decay=0.7)
    local_groups.get(2).run(ranks.modes_agree, case, timeout_s=240)


def test_guardrail_falls_back_per_step_with_the_same_bits(local_groups):
    # Zipf traffic collides 40-60% per step: a 50% guardrail trips on some steps, not others.
    case = ranks.Case(optimizer=RowWiseAdagrad(lr=0.1), collision_rate=None, max_collision_rate=0.5)
    (result, _) = local_groups.get(2).run(ranks.modes_agree, case, timeout_s=240)
    lookups = result["lookup"][1:]
    assert "fallback" in lookups and "prefetched" in lookups
    for lookup, pct in zip(lookups, result["collision_pct"][1:], strict=True):
        assert (lookup == "fallback") == (pct > 50.0)


def test_two_threads_and_pooling(local_groups):
    case = ranks.Case(
        optimizer=RowWiseAdagrad(lr=0.1), collision_rate=0.2, threads=2, pooling="mean"
    )
    local_groups.get(2).run(ranks.modes_agree, case, False, timeout_s=240)


def test_sync_runs_repeat_bit_for_bit(local_groups):
    case = ranks.Case(optimizer=RowWiseAdagrad(lr=0.1), collision_rate=None, steps=20, threads=2)
    local_groups.get(2).run(ranks.runs_repeat, case, timeout_s=240)
