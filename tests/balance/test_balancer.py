"""The balancing protocol across real local processes over Gloo: round trips and bad input."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from freescale_balance import (
    BalanceError,
    Balancer,
    BalancerConfig,
    CostFitConfig,
    JaggedBatch,
    JaggedTensor,
)
from freescale_balance.exchange import KERNELS_ENV, kernels_enabled

POLICIES = ("none", "fbs", "vbs", "kk")


def random_batch(rank: int, seed: int, size: int, max_length: int = 40) -> JaggedBatch:
    """A deterministic batch for ``rank``: three features of different dtypes and shapes."""
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    lengths = torch.randint(0, max_length, (size,), generator=generator)
    if size:
        lengths[0] = 0  # an empty history
    timestamps = torch.randint(0, 5, (size,), generator=generator, dtype=torch.int32)
    embeds = torch.randint(0, 3, (size,), generator=generator)
    return JaggedBatch(
        features={
            "item_ids": JaggedTensor(
                torch.randint(0, 10**9, (int(lengths.sum()),), generator=generator), lengths
            ),
            "timestamps": JaggedTensor(
                torch.rand(int(timestamps.sum()), generator=generator, dtype=torch.float64),
                timestamps,
            ),
            "side": JaggedTensor(
                torch.randn(int(embeds.sum()), 3, generator=generator).to(torch.bfloat16), embeds
            ),
        },
        dense={
            "label": torch.rand(size, generator=generator),
            "num_candidates": torch.randint(0, 4, (size,), generator=generator),
            "dense": torch.randn(size, 2, 2, generator=generator),
            "flag": torch.rand(size, generator=generator) > 0.5,
        },
    )


def _concat(batches: list[JaggedBatch]) -> JaggedBatch:
    first = batches[0]
    return JaggedBatch(
        features={
            name: JaggedTensor(
                torch.cat([b.features[name].values for b in batches]),
                torch.cat([b.features[name].lengths for b in batches]),
            )
            for name in first.features
        },
        dense={name: torch.cat([b.dense[name] for b in batches]) for name in first.dense},
    )


def round_trip(policy: str, seed: int, sizes: list[int]) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = BalancerConfig(
        policy=policy, length_feature="item_ids", candidates_field="num_candidates"
    )
    balancer = Balancer(config)
    local = random_batch(rank, seed, sizes[rank])
    moved, plan = balancer.shuffle(local)

    # Expected: the global batch (rebuilt from every rank's seed) restricted to this rank's share.
    global_batch = _concat([random_batch(r, seed, sizes[r]) for r in range(world)])
    assert moved.equal(global_batch.select(plan.partition.samples_of(rank)))

    back = balancer.unshuffle(moved, plan)
    assert back.equal(local)
    # Per-sample outputs (one loss per received sample) come back in the loaded order.
    losses = moved.dense["label"] * 2 + moved.features["item_ids"].lengths
    assert torch.equal(
        balancer.unshuffle(losses, plan),
        local.dense["label"] * 2 + local.features["item_ids"].lengths,
    )
    balancer.close()
    return {"received": moved.batch_size, "straggler": plan.straggler()}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("policy", POLICIES)
def test_shuffle_then_unshuffle_is_exact(local_groups, world, policy):
    group = local_groups.get(world)
    sizes = [7, 0, 12, 5] if world == 4 else [9, 4]  # uneven, one rank loads nothing
    for seed in range(3):
        results = group.run(round_trip, policy, seed, sizes)
        assert sum(r["received"] for r in results) == sum(sizes)


def async_steps(steps: int) -> bool:
    rank = dist.get_rank()
    balancer = Balancer(BalancerConfig(policy="kk"))
    synchronous = Balancer(BalancerConfig(policy="kk"))
    batches = [random_batch(rank, 100 + s, 16) for s in range(steps)]
    futures = [balancer.shuffle_async(b) for b in batches]  # all in flight at once
    for batch, future in zip(batches, futures, strict=True):
        moved, plan = future.wait()
        expected, _ = synchronous.shuffle(batch)
        assert moved.equal(expected)
        assert balancer.unshuffle_async(moved, plan).wait().equal(batch)
    balancer.close()
    synchronous.close()
    return True


def test_async_shuffles_run_in_order_and_match_sync(local_groups):
    assert local_groups.get(2).run(async_steps, 4) == [True, True]


def overlapped_steps(steps: int) -> bool:
    """The README's loop: step t's synchronous unshuffle while t+1's shuffle is in flight."""
    rank = dist.get_rank()
    balancer = Balancer(BalancerConfig(policy="fbs"))
    batches = [random_batch(rank, 200 + s, 8 + 3 * rank + s % 5) for s in range(steps)]
    future = balancer.shuffle_async(batches[0])
    for step in range(steps):
        moved, plan = future.wait()
        if step + 1 < steps:
            future = balancer.shuffle_async(batches[step + 1])
        assert balancer.unshuffle(moved, plan).equal(batches[step])
        balancer.report_step_time(plan, 1e-3 * (rank + 1))
    balancer.close()
    return True


def test_synchronous_calls_run_after_asynchronous_ones_on_every_rank(local_groups):
    assert local_groups.get(2).run(overlapped_steps, 12) == [True, True]


def tune_vbs() -> float:
    rank = dist.get_rank()
    balancer = Balancer(BalancerConfig(policy="vbs"))
    start = balancer.tuner.alpha
    for step in range(6):
        _, plan = balancer.shuffle(random_batch(rank, step, 32, max_length=400))
        mine = plan.sequence_lengths[plan.partition.ranks == rank].to(torch.float64)
        seconds = float(mine.pow(2.0).sum()) * 1e-6 + 1e-3  # a quadratic "measured" time
        balancer.report_step_time(plan, seconds)
    assert balancer.tuner.alpha > start  # quadratic cost pulls alpha above its 1.5 start
    return balancer.tuner.alpha


def known_counts_and_fit() -> tuple:
    """``shuffle`` with agreed counts from a task on the balancer's own thread, then
    ``observe`` with every rank's (the same) times: the fit, identical on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    fit = CostFitConfig(warmup_steps=1, min_steps=2)
    balancer = Balancer(BalancerConfig(policy="kk", length_feature="item_ids", fit=fit))
    reference = Balancer(BalancerConfig(policy="kk", length_feature="item_ids"))
    for step in range(5):
        batch = random_batch(rank, step, 8 + step, max_length=400)
        counts = torch.tensor([8 + step] * world)
        # The task runs on the balancer's thread; its shuffle runs there at once, no preflight.
        moved, plan = balancer.submit(balancer.shuffle, batch, counts).result(timeout=60)
        if step < 2:  # before the fit: the same partition as with the preflight
            expected, expected_plan = reference.shuffle(batch)
            assert torch.equal(plan.partition.ranks, expected_plan.partition.ranks)
            assert moved.equal(expected)
        lengths = plan.sequence_lengths.to(torch.float64)
        times = [
            float((2e-9 * lengths**2 + 1e-6 * lengths + 1e-4)[plan.partition.ranks == r].sum())
            for r in range(world)
        ]
        balancer.submit(balancer.observe, plan, times).result(timeout=60)
    with pytest.raises(BalanceError, match="local_counts says rank"):
        balancer.shuffle(random_batch(rank, 9, 3), torch.tensor([4] * world))
    model = balancer.cost_model
    balancer.close()
    reference.close()
    return balancer.cost_fit.fitted, model.quadratic, model.linear, model.constant


def test_agreed_counts_skip_the_preflight_and_observed_times_fit_alike(local_groups):
    results = local_groups.get(2).run(known_counts_and_fit)
    assert results[0] == results[1]
    fitted, quadratic, linear, constant = results[0]
    assert fitted
    assert quadratic == pytest.approx(2e-9, rel=1e-6)
    assert linear == pytest.approx(1e-6, rel=1e-6)
    assert constant == pytest.approx(1e-4, rel=1e-6)


def test_vbs_alpha_follows_reported_step_times(local_groups):
    alphas = local_groups.get(2).run(tune_vbs)
    assert alphas[0] == alphas[1]


def _bad_batch(kind: str) -> JaggedBatch:
    batch = random_batch(dist.get_rank(), 5, 6)
    ids = batch.features["item_ids"]
    if kind == "negative":
        lengths = ids.lengths.clone()
        lengths[1], lengths[2] = -1, lengths[2] + lengths[1] + 1
        return JaggedBatch(
            {**batch.features, "item_ids": JaggedTensor(ids.values, lengths)}, batch.dense
        )
    if kind == "float":
        return JaggedBatch(
            {**batch.features, "item_ids": JaggedTensor(ids.values, ids.lengths.float())},
            batch.dense,
        )
    if kind == "mismatch":
        return JaggedBatch(
            {**batch.features, "item_ids": JaggedTensor(ids.values[:-1], ids.lengths)}, batch.dense
        )
    if kind == "dtype":
        return JaggedBatch(
            {**batch.features, "item_ids": JaggedTensor(ids.values.to(torch.int32), ids.lengths)},
            batch.dense,
        )
    if kind == "features":
        return JaggedBatch({k: v for k, v in batch.features.items() if k != "side"}, batch.dense)
    raise AssertionError(kind)


def bad_input_everywhere(kind: str, bad_rank: int) -> str:
    balancer = Balancer(BalancerConfig(policy="fbs", length_feature="item_ids"))
    rank = dist.get_rank()
    batch = _bad_batch(kind) if rank == bad_rank else random_batch(rank, 5, 6)
    try:
        balancer.shuffle(batch)
    except BalanceError as error:
        message = str(error)
    else:
        raise AssertionError("bad input was accepted")
    # The group is still usable afterwards: nothing was half sent.
    moved, plan = balancer.shuffle(random_batch(rank, 6, 6))
    assert balancer.unshuffle(moved, plan).equal(random_batch(rank, 6, 6))
    balancer.close()
    return message


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("negative", "rank 1: feature 'item_ids': length of sample 1 is negative"),
        ("float", "rank 1: feature 'item_ids': lengths must be an integer tensor"),
        ("mismatch", "rank 1: feature 'item_ids': lengths sum to"),
        ("dtype", "rank 1 has a batch schema different"),
        ("features", "rank 1 has a batch schema different"),
    ],
)
def test_bad_input_raises_the_same_clear_error_on_every_rank(local_groups, kind, expected):
    messages = local_groups.get(2).run(bad_input_everywhere, kind, 1)
    assert messages[0] == messages[1]
    assert expected in messages[0]


def wrong_output_count() -> str:
    balancer = Balancer(BalancerConfig(policy="kk"))
    rank = dist.get_rank()
    moved, plan = balancer.shuffle(random_batch(rank, 9, 8))
    outputs = moved.dense["label"][:-1] if rank == 0 else moved.dense["label"]
    with pytest.raises(BalanceError) as error:
        balancer.unshuffle(outputs, plan)
    balancer.close()
    return str(error.value)


def test_unshuffle_refuses_outputs_that_do_not_match_the_plan(local_groups):
    messages = local_groups.get(2).run(wrong_output_count)
    assert messages[0] == messages[1]
    assert "rank 0: outputs hold" in messages[0]


def round_trip_without_kernels(policy: str, seed: int, sizes: list[int]) -> dict:
    """``round_trip`` with ``FREESCALE_BALANCE_KERNELS=0`` (read when a batch is packed): the
    built-in packing."""
    with mock.patch.dict(os.environ, {KERNELS_ENV: "0"}):
        assert not kernels_enabled()
        return round_trip(policy, seed, sizes)


def test_built_in_packing_matches_when_freescale_kernels_is_disabled(local_groups):
    # On the shared ranks: the variable is read at each packing, not at import.
    results = local_groups.get(2).run(round_trip_without_kernels, "kk", 11, [9, 4])
    assert sum(r["received"] for r in results) == 13


def min_gain_steps() -> list[bool]:
    """A batch whose FBS partition barely helps stays put; a lopsided one moves."""
    rank = dist.get_rank()
    balancer = Balancer(BalancerConfig(policy="fbs", length_feature="item_ids", min_gain=0.2))
    kept = []
    for lengths in ([[10, 11], [11, 10]], [[40, 40], [1, 1]]):
        mine = torch.tensor(lengths[rank])
        local = JaggedBatch(
            features={"item_ids": JaggedTensor(torch.arange(int(mine.sum())), mine)},
            dense={"label": torch.arange(2.0) + 10 * rank},
        )
        moved, plan = balancer.shuffle(local)
        kept.append(plan.kept)
        if plan.kept:
            assert moved is local
        assert balancer.unshuffle(moved, plan).equal(local)
    balancer.close()
    return kept


def test_min_gain_keeps_batches_whose_balancing_gains_little(local_groups):
    assert local_groups.get(2).run(min_gain_steps) == [[True, False], [True, False]]
    with pytest.raises(ValueError, match="min_gain"):
        BalancerConfig(min_gain=1.0)
