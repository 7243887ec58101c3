"""Bad input raises the same clear error on every rank before any ID moves; the group survives."""

from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from freescale_balance import JaggedBatch, JaggedTensor
from freescale_embed import (
    EmbeddingInputError,
    RowWiseAdagrad,
    ShardedEmbeddingCollection,
    TableConfig,
)
from freescale_embed.config import check_tables
from freescale_embed.prefetch import UpdateLost
from freescale_embed.transfers import PendingExchange
from freescale_embed.workload import make_batch
from tests.embed.ranks import TABLES, Case

BAD_RANK = 1


def _batches(steps: int) -> list[JaggedBatch]:
    workload = Case().workload(dist.get_world_size())
    return [make_batch(workload, dist.get_rank(), step) for step in range(steps)]


def _with_feature(batch: JaggedBatch, name: str, feature: JaggedTensor | None) -> JaggedBatch:
    features = {k: v for k, v in batch.features.items() if k != name}
    if feature is not None:
        features[name] = feature
    return JaggedBatch(features, batch.dense)


def _spoil(batch: JaggedBatch, kind: str) -> JaggedBatch:
    category = batch.features["category"]
    history = batch.features["history"]
    if kind == "too_large":
        values = category.values.clone()
        values[0] = 61  # the table has rows 0..60
        return _with_feature(batch, "category", JaggedTensor(values, category.lengths))
    if kind == "negative":
        values = history.values.clone()
        values[1] = -4
        return _with_feature(batch, "history", JaggedTensor(values, history.lengths))
    if kind == "mismatch":
        return _with_feature(batch, "history", JaggedTensor(history.values[:-1], history.lengths))
    if kind == "missing":
        return _with_feature(batch, "flag", None)
    if kind == "float_ids":
        return _with_feature(
            batch, "category", JaggedTensor(category.values.float(), category.lengths)
        )
    if kind == "wrong_device":
        return _with_feature(
            batch, "category", JaggedTensor(category.values.to("meta"), category.lengths)
        )
    raise AssertionError(kind)


def _loss(out: dict) -> torch.Tensor:
    return sum(o.values.sum() for o in out.values())


def bad_batch(kind: str, mode: str) -> str:
    """Rank ``BAD_RANK`` passes a spoiled batch; every rank must raise the same error."""
    rank = dist.get_rank()
    emb = ShardedEmbeddingCollection(TABLES, optimizer=RowWiseAdagrad(lr=0.1), mode=mode)
    batches = _batches(3)
    spoiled = _spoil(batches[0], kind) if rank == BAD_RANK else batches[0]
    args = (spoiled,) if mode == "sync" else (spoiled, batches[1])
    with pytest.raises(EmbeddingInputError) as error:
        emb(*args)
    # Nothing was half sent: the same collection trains on good batches afterwards.
    good = (batches[0],) if mode == "sync" else (batches[0], batches[1])
    _loss(emb(*good)).backward()
    emb.close()
    return str(error.value)


@pytest.mark.parametrize("mode", ["sync", "prioritized"])
@pytest.mark.parametrize(
    "kind, expected",
    [
        (
            "too_large",
            "rank 1: feature 'category': ID 61 at position 0 is out of range for table "
            "'categories' (rows 0..60)",
        ),
        ("negative", "rank 1: feature 'history': ID -4 at position 1 is out of range"),
        ("mismatch", "rank 1: feature 'history': lengths sum to"),
        ("missing", "rank 1: feature 'flag' (table 'tiny') is not in the batch"),
        ("float_ids", "rank 1: feature 'category': IDs must be a 1-D integer tensor"),
        (
            "wrong_device",
            "rank 1: feature 'category': IDs and lengths must be on the tables' device cpu, "
            "got meta and cpu",
        ),
    ],
)
def test_bad_batches_raise_everywhere(local_groups, kind, expected, mode):
    messages = local_groups.get(2).run(bad_batch, kind, mode)
    assert messages[0] == messages[1]
    assert expected in messages[0]


def _raises_in_forward_or_backward(
    emb: ShardedEmbeddingCollection, call: tuple, final: bool = False
) -> tuple[str, str]:
    """Where the call's ``EmbeddingInputError`` surfaced on this rank, and its message.

    A collective runs between forward and backward, as DDP's or a metric's would: it must pair
    up on every rank (no rank may have left at forward).
    """
    try:
        out = emb(*call, final=final)
    except EmbeddingInputError as error:
        return "forward", str(error)
    dist.all_reduce(torch.ones(1))
    with pytest.raises(EmbeddingInputError) as error:
        _loss(out).backward()
    return "backward", str(error.value)


def prioritized_misuse(kind: str) -> tuple[str, str]:
    """Prioritized-mode protocol errors on rank ``BAD_RANK``; training goes on afterwards.

    A prioritized step's preflight rides on the next step's background routing: every rank's
    forward returns and every rank raises in backward, and the step is undone everywhere, so
    the corrected call trains on.
    """
    rank = dist.get_rank()
    emb = ShardedEmbeddingCollection(TABLES, optimizer=RowWiseAdagrad(lr=0.1), mode="prioritized")
    batches = _batches(3)
    bad = rank == BAD_RANK
    _loss(emb(batches[0], batches[1])).backward()
    if kind == "no_next":
        call = (batches[1],) if bad else (batches[1], batches[2])
    elif kind == "different":
        history = batches[1].features["history"]
        values = history.values.clone()
        values[0] = (values[0] + 1) % 400
        changed = _with_feature(batches[1], "history", JaggedTensor(values, history.lengths))
        call = (changed if bad else batches[1], batches[2])
    elif kind == "bad_next":
        call = (batches[1], _spoil(batches[2], "too_large") if bad else batches[2])
    elif kind == "final_disagrees":
        call = (batches[1],) if bad else (batches[1], batches[2])
    else:
        raise AssertionError(kind)
    where, message = _raises_in_forward_or_backward(emb, call, kind == "final_disagrees" and bad)
    _loss(emb(batches[1], batches[2])).backward()
    _loss(emb(batches[2], final=True)).backward()
    # The undone step left no telemetry record of its own (its retry has the step's record).
    assert [record.step for record in emb.telemetry] == [1, 2, 3]
    state = emb.state_dict(full=True)
    emb.close()
    # The same training without the error, for comparison.
    clean = ShardedEmbeddingCollection(TABLES, optimizer=RowWiseAdagrad(lr=0.1), mode="prioritized")
    _loss(clean(batches[0], batches[1])).backward()
    _loss(clean(batches[1], batches[2])).backward()
    _loss(clean(batches[2], final=True)).backward()
    expected = clean.state_dict(full=True)
    clean.close()
    assert all(torch.equal(state[key], expected[key]) for key in expected)
    return where, message


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("no_next", "rank 1: prioritized mode needs next_batch"),
        ("different", "rank 1: the batch differs from the next_batch given at the previous step"),
        ("bad_next", "rank 1: next batch: feature 'category': ID 61 at position 0 is out of"),
        ("final_disagrees", "ranks [1] passed final=True but the others a next_batch"),
    ],
)
def test_prioritized_protocol_errors_raise_everywhere(local_groups, kind, expected):
    (where_good, good), (where_bad, bad) = local_groups.get(2).run(prioritized_misuse, kind)
    assert good == bad
    assert expected in good
    assert (where_good, where_bad) == ("backward", "backward")


def forward_twice() -> str:
    emb = ShardedEmbeddingCollection(TABLES, mode="prioritized")
    batches = _batches(3)
    out = emb(batches[0], batches[1])
    with pytest.raises(EmbeddingInputError) as error:
        emb(batches[1], batches[2])
    loss = _loss(out)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="ran twice"):
        loss.backward()
    _loss(emb(batches[1], final=True)).backward()
    emb.close()
    return str(error.value)


def test_prioritized_needs_each_backward_before_the_next_forward(local_groups):
    messages = local_groups.get(2).run(forward_twice)
    assert "step 1 has not run its backward" in messages[0]


def _refusals(emb: ShardedEmbeddingCollection, forward: Callable[[], object]) -> list[str]:
    """The errors of ``forward``, ``synchronize`` and ``close`` of a collection that must refuse
    to go on; ``close`` still frees its thread and groups."""
    messages = []
    for call in (forward, emb.synchronize, emb.close):
        with pytest.raises(RuntimeError) as error:
            call()
        messages.append(str(error.value))
    assert emb._strategy.worker is None and not emb._strategy.own_groups
    return messages


def failed_collision_update() -> list[str]:
    """Every rank's wait for step 1's collision gradients fails (after the data arrived, so
    nobody hangs): the collection must refuse to go on rather than train on stale rows."""
    emb = ShardedEmbeddingCollection(TABLES, mode="prioritized")
    batches = _batches(3)
    wait = PendingExchange.wait

    def failing_wait(self: PendingExchange) -> list[torch.Tensor]:
        wait(self)
        raise RuntimeError("injected: the collision AllToAll failed")

    _loss(emb(batches[0], batches[1])).backward()
    assert emb.telemetry[-1].collision_pct is None  # the first step is looked up in forward
    PendingExchange.wait = failing_wait  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="injected"):
            emb(batches[1], batches[2])
    finally:
        PendingExchange.wait = wait  # type: ignore[method-assign]
    return _refusals(emb, lambda: emb(batches[1], batches[2]))


def test_a_failed_collision_update_stops_the_collection(local_groups):
    for messages in local_groups.get(2).run(failed_collision_update):
        assert all("collision gradients of step 1 failed" in m for m in messages)
        assert all("load a checkpoint" in m for m in messages)


def lost_deferred_update() -> list[str]:
    """Every rank fails to apply step 1's gradients outside its collision rows (in step 3's
    prefetch, on the prefetch thread): the collection must refuse to go on."""
    emb = ShardedEmbeddingCollection(TABLES, mode="prioritized")
    batches = _batches(3)

    def failing_apply(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected: out of memory")

    _loss(emb(batches[0], batches[1])).backward()
    with mock.patch("freescale_embed.prefetch.apply_gradients", failing_apply):
        out = emb(batches[1], batches[2])
        with pytest.raises(UpdateLost, match="gradients of step 1 outside its collision rows"):
            _loss(out).backward()
    return _refusals(emb, lambda: emb(batches[2], final=True))


def test_a_lost_deferred_update_stops_the_collection(local_groups):
    for messages in local_groups.get(2).run(lost_deferred_update):
        assert all("injected: out of memory" in m for m in messages)
        assert all("tables are incomplete" in m for m in messages)


def test_configuration_errors():
    with pytest.raises(ValueError, match="without '\\.'"):
        TableConfig("a.b", 10, 4, ["f"])
    with pytest.raises(TypeError, match="not one string"):
        TableConfig("a", 10, 4, "f")
    with pytest.raises(ValueError, match="num_embeddings"):
        TableConfig("a", 0, 4, ["f"])
    with pytest.raises(ValueError, match="reads both table 'a' and table 'b'"):
        check_tables([TableConfig("a", 10, 4, ["f"]), TableConfig("b", 10, 4, ["g", "f"])])
    with pytest.raises(ValueError, match="used twice"):
        check_tables([TableConfig("a", 10, 4, ["f"]), TableConfig("a", 10, 4, ["g"])])
