"""Prioritized mode is bitwise synchronous training; sync mode is the dense reference.

Real ranks over Gloo and over the ``freescale`` backend (UCX on loopback), 50 steps per run. Each
case trains a sync and a prioritized collection on the same batches in the same processes and
requires ``torch.equal`` of every output of every step, of the final tables and of the optimizer
state; the sync run must also match a dense float64 single-process reference of the global batch
to float32 rounding.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from freescale_embed import SGD, Adam, RowWiseAdagrad
from tests.embed import ranks
from tests.embed.test_inputs import bad_batch
from tests.harness import LocalGroup, LocalGroups
from tests.xdist_groups import FREESCALE_GROUPS

OPTIMIZERS = {"sgd": SGD(lr=0.1), "rowwise_adagrad": RowWiseAdagrad(lr=0.1)}
# Exact collision rates of consecutive steps, and plain Zipf IDs over the whole table (None),
# whose hot rows collide in every step.
RATES = [0.0, 0.05, 0.2, 0.5, None]

NO_UCXX = importlib.util.find_spec("ucxx") is None
FREESCALE = pytest.mark.skipif(NO_UCXX, reason="the freescale backend needs ucxx")


def _group(local_groups: LocalGroups, world: int, backend: str) -> LocalGroup:
    if backend == "freescale":
        return local_groups.get(world, backend="freescale", setup="freescale_comm:register")
    return local_groups.get(world)


def _rate_id(rate: float | None) -> str:
    return "zipf" if rate is None else f"{rate:.0%}"


def _cases() -> list[Any]:
    """Every (optimizer, rate) on 2 Gloo ranks; elsewhere each optimizer and each rate once.

    Gloo cases come first: the harness stops a backend's groups when another backend's are asked
    for, so alternating backends would restart ranks between cases. On freescale 2 ranks run
    every rate (the optimizers alternate). On 4 ranks (about 5 s a case) each backend runs both
    optimizers, and together the four cases run no collisions, a low and a middle rate and Zipf
    traffic: the backend changes how bytes move, not which code plans them, so the rest of the
    matrix would re-check the same paths.
    """
    gloo = [(2, optimizer, rate, "gloo") for optimizer in OPTIMIZERS for rate in RATES]
    gloo += [(4, "sgd", 0.0, "gloo"), (4, "rowwise_adagrad", 0.2, "gloo")]
    freescale = [
        (2, "sgd", 0.0, "freescale"),
        (2, "rowwise_adagrad", 0.05, "freescale"),
        (2, "sgd", 0.2, "freescale"),
        (2, "rowwise_adagrad", 0.5, "freescale"),
        (2, "sgd", None, "freescale"),
        (4, "sgd", 0.05, "freescale"),
        (4, "rowwise_adagrad", None, "freescale"),
    ]
    return [
        pytest.param(
            *case,
            id=f"{case[3]}-{case[0]}ranks-{case[1]}-{_rate_id(case[2])}",
            marks=[FREESCALE, FREESCALE_GROUPS] if case[3] == "freescale" else [],
        )
        for case in gloo + freescale
    ]


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


def test_batches_staged_by_a_pipeline_keep_the_bits(local_groups):
    # A pipeline's batches are checked on the host, the next one's IDs routed from there.
    case = ranks.Case(optimizer=RowWiseAdagrad(lr=0.1), collision_rate=0.2)
    local_groups.get(2).run(ranks.staged_modes_agree, case, timeout_s=240)


def test_ids_and_plans_on_groups_of_their_own(local_groups):
    # As when the collection's group is NCCL: host collectives then get Gloo groups of their own.
    case = ranks.Case(optimizer=RowWiseAdagrad(lr=0.1), collision_rate=0.2)
    local_groups.get(2).run(ranks.modes_agree_with_separate_host_groups, case, timeout_s=240)


def test_two_threads_and_pooling(local_groups):
    case = ranks.Case(
        optimizer=RowWiseAdagrad(lr=0.1), collision_rate=0.2, threads=2, pooling="mean"
    )
    local_groups.get(2).run(ranks.modes_agree, case, False, timeout_s=240)


def test_cuda_segment_sums_keep_the_modes_bitwise_equal(local_groups):
    # CUDA tables sum gradients by segment_sum_pairwise; its contract, not the device, is what
    # exactness needs, so it is checked here on CPU (Zipf traffic: hot rows, many levels).
    # 4 ranks: a collision row's requesters are then not only its owner, so the copies the
    # requesters update must match the owner's tree sums too.
    case = ranks.Case(optimizer=RowWiseAdagrad(lr=0.1), collision_rate=None)
    local_groups.get(2).run(ranks.modes_agree_with_pairwise_sums, case, timeout_s=240)
    local_groups.get(4).run(ranks.modes_agree_with_pairwise_sums, case, timeout_s=240)


def test_sync_runs_repeat_bit_for_bit(local_groups):
    case = ranks.Case(optimizer=RowWiseAdagrad(lr=0.1), collision_rate=None, steps=20, threads=2)
    local_groups.get(2).run(ranks.runs_repeat, case, timeout_s=240)


# Gloo tests above, freescale ones last (see _cases), so each backend's ranks start once here.
@pytest.mark.parametrize(("world", "optimizer", "rate", "backend"), _cases())
def test_prioritized_is_bitwise_sync_and_sync_is_the_reference(
    local_groups, world, optimizer, rate, backend
):
    case = ranks.Case(optimizer=OPTIMIZERS[optimizer], collision_rate=rate)
    results = _group(local_groups, world, backend).run(ranks.modes_agree, case, timeout_s=240)
    collisions = results[0]["collision_pct"][1:]
    assert results[0]["lookup"][0] == "sync"  # the first step has nothing prefetched
    assert set(results[0]["lookup"][1:]) == {"prefetched"}
    if rate == 0.0:
        assert max(collisions) == 0.0
    elif rate is not None:
        # Every table shares exactly `rate` of its rows; the 3-row table rounds differently.
        assert min(collisions) >= 100 * rate - 2 and max(collisions) <= 100 * rate + 8


@FREESCALE
@FREESCALE_GROUPS
@pytest.mark.parametrize("mode", ["sync", "prioritized"])
def test_bad_input_raises_everywhere_on_freescale(local_groups, mode):
    # The error path gathers every rank's message with the channel's own AllGathers.
    messages = _group(local_groups, 2, "freescale").run(bad_batch, "too_large", mode)
    assert messages[0] == messages[1]
    assert "rank 1: feature 'category': ID 61 at position 0 is out of range" in messages[0]


@FREESCALE
@FREESCALE_GROUPS
def test_prefetch_group_of_cpu_tables_is_gloo(local_groups):
    results = _group(local_groups, 2, "freescale").run(ranks.prefetch_group_backend)
    assert results == [["gloo", [0, 1]]] * 2
