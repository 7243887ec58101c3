"""TrainPipeline on real local groups: numerics against the baseline, order, epoch ends, errors.

Tolerance of "equal to float rounding" (balanced against unbalanced): balancing changes which
rank computes a sample, so the float32 sums of per-sample losses and of the dense gradients
(over ranks by DDP, over samples inside a rank) are taken in another order; over 8 steps of a
16-sample global batch that moves losses by a few ulps, hence ``rtol=1e-5, atol=1e-6``.
Prioritized against sync with the same balancing is compared bitwise.
"""

from __future__ import annotations

import pytest
import torch

from freescale_balance import CostFitConfig
from tests.embed import pipeline_ranks
from tests.harness import LocalGroup, RankFailure

_CLOSE = {"rtol": 1e-5, "atol": 1e-6}


def _assert_runs(a: pipeline_ranks.Run, b: pipeline_ranks.Run, exact: bool) -> None:
    check = torch.testing.assert_close
    if exact:
        assert a.losses == b.losses
        for key in a.dense:
            assert torch.equal(a.dense[key], b.dense[key]), key
        for key in a.tables:
            assert torch.equal(a.tables[key], b.tables[key]), key
        for x, y in zip(a.local_losses, b.local_losses, strict=True):
            assert torch.equal(x, y)
        return
    check(torch.tensor(a.losses), torch.tensor(b.losses), **_CLOSE)
    for key in a.dense:
        check(a.dense[key], b.dense[key], **_CLOSE)
    for key in a.tables:
        check(a.tables[key], b.tables[key], **_CLOSE)
    for x, y in zip(a.local_losses, b.local_losses, strict=True):
        check(x, y, **_CLOSE)


@pytest.mark.parametrize(("world", "policy"), [(2, "fbs"), (2, "vbs"), (2, "kk"), (4, "kk")])
def test_balanced_training_equals_the_baseline_and_prioritized_equals_sync(
    local_groups, world, policy
):
    group = local_groups.get(world)
    baseline = group.run(pipeline_ranks.train, "sync", None)
    balanced_sync = group.run(pipeline_ranks.train, "sync", policy)
    balanced_prioritized = group.run(pipeline_ranks.train, "prioritized", policy)
    for rank in range(world):
        _assert_runs(balanced_sync[rank], baseline[rank], exact=False)
        _assert_runs(balanced_prioritized[rank], balanced_sync[rank], exact=True)
        run = balanced_prioritized[rank]
        # Per-sample outputs come back to the rank that loaded them, in loaded order.
        for got, loaded in zip(run.sample_ids, run.loaded_ids, strict=True):
            assert torch.equal(got, loaded)
        assert run.reports == len(run.losses)


def test_the_pipeline_fits_the_balancers_cost_model_alike_on_every_rank(local_groups):
    # The pipeline gives the balancer each step's gathered compute times: every rank fits the
    # same model to the bit (and so partitions alike), and the result stays the baseline's.
    fit = CostFitConfig(warmup_steps=1, min_steps=2)
    group = local_groups.get(2)
    baseline = group.run(pipeline_ranks.train, "sync", None, steps=10)
    fitted = group.run(pipeline_ranks.train, "prioritized", "fbs", steps=10, fit=fit)
    assert fitted[0].cost_model == fitted[1].cost_model
    assert fitted[0].cost_model[3]  # fit, not the configured model
    for rank in range(2):
        _assert_runs(fitted[rank], baseline[rank], exact=False)


def test_prioritized_without_balancing_equals_sync_with_row_wise_adagrad(local_groups):
    group = local_groups.get(2)
    sync = group.run(pipeline_ranks.train, "sync", None, optimizer="adagrad")
    prioritized = group.run(pipeline_ranks.train, "prioritized", None, optimizer="adagrad")
    for rank in range(2):
        _assert_runs(prioritized[rank], sync[rank], exact=True)


@pytest.mark.parametrize("policy", [None, "fbs"])
def test_uneven_epoch_ends_train_every_sample_and_stop_together(local_groups, policy):
    runs = local_groups.get(2).run(
        pipeline_ranks.train, "prioritized", policy, steps=6, rank_steps={1: 3}
    )
    assert [len(r.losses) for r in runs] == [6, 6]  # rank 1 computed (or lent) empty batches
    assert runs[0].samples == 6 * 8 and runs[1].samples == 3 * 8
    for run in runs:
        for got, loaded in zip(run.sample_ids, run.loaded_ids, strict=False):
            assert torch.equal(got, loaded)
        assert runs[0].losses == run.losses


def test_a_model_without_sharded_embeddings_is_refused(local_groups):
    for message in local_groups.get(2).run(pipeline_ranks.no_collection):
        assert "holds no ShardedEmbeddingCollection" in message


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("not_per_sample", "the model's loss must be one float per sample"),
        ("nan", "the loss of step 3 is not finite"),
        ("id_out_of_range", "is out of range for table 'items'"),
        ("schema_between_ranks", "batch schema differs from rank 0's"),
        ("schema_between_steps", "differs from the first batch's"),
        ("lengths_mismatch", "lengths sum to"),
    ],
)
@pytest.mark.parametrize("mode", ["sync", "prioritized"])
def test_bad_input_raises_the_same_error_on_every_rank(local_groups, kind, expected, mode):
    messages = local_groups.get(2).run(pipeline_ranks.refused, kind, mode)
    assert messages[0] == messages[1], messages
    assert expected in messages[0], messages[0]


@pytest.mark.parametrize(("mode", "policy"), [("prioritized", "fbs"), ("sync", None)])
def test_resume_on_the_same_world_size_is_bitwise(local_groups, tmp_path, mode, policy):
    group = local_groups.get(2)
    whole = group.run(pipeline_ranks.train, mode, policy, optimizer="adagrad")
    directory = str(tmp_path / "checkpoint")
    first = group.run(
        pipeline_ranks.train, mode, policy, steps=4, optimizer="adagrad", save_to=directory
    )
    rest = group.run(pipeline_ranks.train, mode, policy, optimizer="adagrad", load_from=directory)
    for rank in range(2):
        assert first[rank].losses + rest[rank].losses == whole[rank].losses
        for key in whole[rank].tables:
            assert torch.equal(rest[rank].tables[key], whole[rank].tables[key]), key
        for key in whole[rank].dense:
            assert torch.equal(rest[rank].dense[key], whole[rank].dense[key]), key


def test_resume_on_another_world_size_continues_the_same_global_batches(local_groups, tmp_path):
    directory = str(tmp_path / "checkpoint")
    whole = local_groups.get(4).run(pipeline_ranks.train, "prioritized", "kk", optimizer="adagrad")
    local_groups.get(4).run(
        pipeline_ranks.train, "prioritized", "kk", steps=4, optimizer="adagrad", save_to=directory
    )
    rest = local_groups.get(2).run(
        pipeline_ranks.train, "prioritized", "kk", optimizer="adagrad", load_from=directory
    )
    torch.testing.assert_close(
        torch.tensor(rest[0].losses), torch.tensor(whole[0].losses[4:]), **_CLOSE
    )
    for key in whole[0].tables:
        torch.testing.assert_close(rest[0].tables[key], whole[0].tables[key], **_CLOSE)
    for key in whole[0].dense:
        torch.testing.assert_close(rest[0].dense[key], whole[0].dense[key], **_CLOSE)


def test_outputs_can_be_left_where_they_were_computed(local_groups):
    for message in local_groups.get(2).run(pipeline_ranks.without_outputs):
        assert "outputs are not returned" in message


def test_a_rank_that_dies_mid_step_makes_the_survivors_raise_within_the_timeout():
    group = LocalGroup(2, init_timeout_s=20)
    try:
        with pytest.raises(RankFailure) as failure:
            group.run(pipeline_ranks.dies_mid_step, 1, 20.0, timeout_s=90)
    finally:
        group.close()
    assert failure.value.failures[1][0] == "died"
    survivor = failure.value.results[0]
    assert survivor != "no error"
    assert float(survivor.split(" after ")[1].split()[0]) < 20 + 15, survivor
