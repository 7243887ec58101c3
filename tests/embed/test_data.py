"""The training and evaluation streams: deterministic, the same global batches for any world size,
heavy-tailed lengths, leave-one-out MovieLens-100K."""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterable, Iterator

import numpy as np
import pytest
import torch

from freescale_balance import JaggedBatch, JaggedTensor
from freescale_embed.data import (
    SyntheticConfig,
    SyntheticDataset,
    synthetic_batches,
    synthetic_eval_batches,
    synthetic_item_counts,
)
from freescale_embed.data.synthetic import counter_uniform

CONFIG = SyntheticConfig(
    num_users=256, num_items=400, max_history=64, global_batch_size=16, num_negatives=8
)


def concat(batches: Iterable[JaggedBatch]) -> JaggedBatch:
    batches = list(batches)
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


def global_steps(stream: Iterator[JaggedBatch], steps: int) -> list[JaggedBatch]:
    return list(itertools.islice(stream, steps))


def by_rank(config: SyntheticConfig, world_size: int, steps: int) -> list[JaggedBatch]:
    """Each step's batches of all ranks, concatenated in rank order."""
    streams = [
        global_steps(synthetic_batches(config, r, world_size), steps) for r in range(world_size)
    ]
    return [concat(parts) for parts in zip(*streams, strict=True)]


def test_stream_is_deterministic_per_seed():
    first = global_steps(synthetic_batches(CONFIG, 0, 1), 3)
    again = global_steps(synthetic_batches(CONFIG, 0, 1), 3)
    other = global_steps(synthetic_batches(dataclasses.replace(CONFIG, seed=1), 0, 1), 3)
    assert all(a.equal(b) for a, b in zip(first, again, strict=True))
    assert not first[0].features["history"].equal(other[0].features["history"])
    batch = first[0]
    batch.validate()
    assert set(batch.features) == {"history", "negatives"}
    assert batch.features["history"].values.dtype == torch.int64
    assert torch.equal(batch.dense["sample_id"], torch.arange(16))
    assert torch.equal(batch.features["negatives"].lengths, torch.full((16,), 8))


@pytest.mark.parametrize("world_size", [2, 4])
def test_global_batches_do_not_depend_on_world_size(world_size):
    # Step 17 is in the second epoch (16 steps per epoch): a new order, new negatives.
    config = dataclasses.replace(CONFIG, num_steps=18)
    single = by_rank(config, 1, 18)
    split = by_rank(config, world_size, 18)
    assert all(a.equal(b) for a, b in zip(single, split, strict=True))
    assert single[0].batch_size == 16
    assert synthetic_batches(config, world_size - 1, world_size).__next__().batch_size == (
        16 // world_size
    )


def test_start_step_equals_skipping():
    config = dataclasses.replace(CONFIG, num_steps=20)
    straight = global_steps(synthetic_batches(config, 1, 2), 20)
    resumed = list(synthetic_batches(config, 1, 2, start_step=15))
    assert len(resumed) == 5
    assert all(a.equal(b) for a, b in zip(straight[15:], resumed, strict=True))


def test_epochs_cover_every_user_once_in_a_new_order():
    config = dataclasses.replace(CONFIG, num_steps=32)
    users = torch.cat([b.dense["user_id"] for b in synthetic_batches(config, 0, 1)])
    first, second = users[:256], users[256:]
    assert torch.equal(first.sort().values, torch.arange(256))
    assert torch.equal(second.sort().values, torch.arange(256))
    assert not torch.equal(first, second)
    assert torch.equal(
        torch.cat([b.dense["sample_id"] for b in synthetic_batches(config, 0, 1)]),
        torch.arange(512),
    )
    assert len(list(synthetic_batches(CONFIG, 0, 1))) == 16  # one epoch by default


def test_uneven_world_is_refused_at_the_call():
    with pytest.raises(ValueError, match="not divisible by the world size 3"):
        synthetic_batches(CONFIG, 0, 3)
    with pytest.raises(ValueError, match="rank 2"):
        synthetic_batches(CONFIG, 2, 2)


def test_negatives_depend_on_the_sample_only():
    config = dataclasses.replace(CONFIG, num_steps=4)
    seen: dict[int, torch.Tensor] = {}
    for world_size in (1, 2, 4):
        for rank in range(world_size):
            for batch in synthetic_batches(config, rank, world_size):
                negatives = batch.features["negatives"].values.view(batch.batch_size, -1)
                for sample_id, row in zip(
                    batch.dense["sample_id"].tolist(), negatives, strict=True
                ):
                    assert torch.equal(seen.setdefault(sample_id, row), row)
    assert len(seen) == 64
    rows = torch.stack(list(seen.values()))
    assert rows.min() >= 0 and rows.max() < config.num_items
    assert len({tuple(r.tolist()) for r in rows}) == 64


def test_lengths_are_heavy_tailed_within_bounds():
    config = SyntheticConfig(num_users=20_000, num_items=1_000, max_history=512)
    lengths = SyntheticDataset(config).lengths
    assert lengths.min() >= 3 and lengths.max() <= 512
    median = np.median(lengths)
    assert 58 <= median <= 70  # 512 / 8 = 64
    # Log-normal with sigma 0.75: the 99th percentile is exp(2.33 * 0.75) = 5.7x the median.
    assert 4.5 * median <= np.percentile(lengths, 99) <= 7 * median
    assert (lengths == 512).any()  # the cap is reached
    fewer = SyntheticDataset(dataclasses.replace(config, num_users=500)).lengths
    assert np.array_equal(fewer, lengths[:500])  # a user's length depends on (seed, user)


def test_sequences_follow_the_transition_table():
    config = SyntheticConfig(num_users=2_000, num_items=1_000, max_history=64)
    dataset = SyntheticDataset(config)
    items, lengths = dataset.sequences(np.arange(2_000))
    follows = items[1:] == dataset.transition[items[:-1]]
    within = np.ones(items.size - 1, dtype=bool)
    within[np.cumsum(lengths)[:-1] - 1] = False  # pairs across users
    # 0.7 by construction plus the fresh draws that happen to equal the transition.
    assert 0.68 <= follows[within].mean() <= 0.75
    longer, _ = dataset.sequences(np.arange(2_000), extra=1)
    ends = np.cumsum(lengths + 1)
    assert np.array_equal(np.delete(longer, ends - 1), items)  # held-out item comes after


def test_counter_hash_is_uniform_and_keyed():
    u = counter_uniform(3, 0, np.arange(100_000))
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.005
    assert np.array_equal(u[10:20], counter_uniform(3, 0, np.arange(10, 20)))
    assert not np.array_equal(u[:10], counter_uniform(3, 1, np.arange(10)))
    assert not np.array_equal(u[:10], counter_uniform(4, 0, np.arange(10)))


def check_eval_batches(batches: list[JaggedBatch], histories: dict[int, torch.Tensor]) -> None:
    for batch in batches:
        batch.validate()
        candidates = batch.features["candidates"].values.view(batch.batch_size, 101)
        offsets = batch.features["history"].offsets()
        for i, user in enumerate(batch.dense["user_id"].tolist()):
            history = batch.features["history"].values[offsets[i] : offsets[i + 1]]
            assert torch.equal(history, histories[user])
            negatives = candidates[i, 1:]
            assert negatives.unique().numel() == 100
            seen = torch.cat([history, candidates[i, :1]])
            assert not torch.isin(negatives, seen).any()


def test_synthetic_eval_batches():
    config = dataclasses.replace(CONFIG, num_eval_users=50)
    dataset = SyntheticDataset(config)
    histories = {
        u: torch.from_numpy(dataset.sequences(np.array([u]))[0]) for u in range(config.num_users)
    }
    whole = list(synthetic_eval_batches(config, 0, 1, batch_size=16))
    assert [b.batch_size for b in whole] == [16, 16, 16, 2]
    check_eval_batches(whole, histories)
    held_out = torch.cat([b.features["candidates"].values.view(-1, 101)[:, 0] for b in whole])
    expected = [dataset.sequences(np.array([u]), extra=1)[0][-1] for u in range(50)]
    assert held_out.tolist() == expected
    parts = [list(synthetic_eval_batches(config, r, 3, batch_size=16)) for r in range(3)]
    split = concat(itertools.chain.from_iterable(parts))
    assert concat(whole).equal(split)  # contiguous blocks, candidates keyed by (seed, user)


def test_item_counts_cover_every_training_item():
    counts = synthetic_item_counts(CONFIG)
    assert counts.shape == (400,)
    assert int(counts.sum()) == int(SyntheticDataset(CONFIG).lengths.sum())


# -- MovieLens-100K (needs RecBole's bundled copy) ------------------------------------------------


@pytest.fixture(scope="module")
def movielens():
    pytest.importorskip("recbole", reason="pip install --no-deps recbole==1.2.1")
    from freescale_embed.data import movielens

    return movielens


def raw_interactions(movielens) -> dict[str, list[tuple[float, str]]]:
    per_user: dict[str, list[tuple[float, str]]] = {}
    with movielens.movielens_path().open() as lines:
        next(lines)
        for line in lines:
            user, item, _rating, timestamp = line.rstrip("\n").split("\t")
            per_user.setdefault(user, []).append((float(timestamp), item))
    return per_user


def test_movielens_is_time_ordered_leave_one_out(movielens):
    data = movielens.load_movielens()
    assert (data.num_users, data.num_items, int(data.lengths.sum())) == (943, 1682, 100_000)
    assert data.item_tokens[:3] == ("1", "2", "3")  # dense IDs in token order
    raw = raw_interactions(movielens)
    ends = np.cumsum(data.lengths)
    for user in (0, 1, 100, 942):
        token = data.user_tokens[user]
        # Time order, ties by dense ID (= numeric token order).
        expected = [item for _, item in sorted(raw[token], key=lambda r: (r[0], int(r[1])))]
        mine = data.items[ends[user] - data.lengths[user] : ends[user]]
        assert [data.item_tokens[i] for i in mine] == expected
        assert data.held_out[user] == mine[-1]
        history = data.history(np.array([user]), max_history=10_000).values.numpy()
        assert np.array_equal(history, mine[:-1])
        recent = data.history(np.array([user]), max_history=5).values.numpy()
        assert np.array_equal(recent, mine[-6:-1])
    assert int(data.item_counts().sum()) == 100_000 - 943


def test_movielens_stream_and_eval(movielens):
    config = movielens.MovieLensConfig(max_history=50, num_negatives=16, global_batch_size=32)
    assert len(list(movielens.movielens_batches(config, 0, 1))) == 943 // 32  # one epoch
    config = dataclasses.replace(config, num_steps=30)
    single = global_steps(movielens.movielens_batches(config, 0, 1), 30)
    split = [
        concat(parts)
        for parts in zip(
            *(global_steps(movielens.movielens_batches(config, r, 4), 30) for r in range(4)),
            strict=True,
        )
    ]
    assert all(a.equal(b) for a, b in zip(single, split, strict=True))
    resumed = list(movielens.movielens_batches(config, 0, 1, start_step=28))
    assert all(a.equal(b) for a, b in zip(single[28:], resumed, strict=True))
    lengths = torch.cat([b.features["history"].lengths for b in single])
    assert lengths.min() >= 19 and lengths.max() == 50
    data = movielens.load_movielens()
    histories = {u: data.history(np.array([u]), 50).values for u in range(data.num_users)}
    batches = list(movielens.movielens_eval_batches(config, 1, 2, batch_size=200))
    assert sum(b.batch_size for b in batches) == 471
    check_eval_batches(batches, histories)
    candidates = torch.cat([b.features["candidates"].values.view(-1, 101) for b in batches])
    users = torch.cat([b.dense["user_id"] for b in batches])
    assert torch.equal(candidates[:, 0], torch.from_numpy(data.held_out)[users])
    ends = np.cumsum(data.lengths)
    for user, row in zip(users[:20].tolist(), candidates[:20], strict=True):
        rated = data.items[ends[user] - data.lengths[user] : ends[user]]
        assert not np.isin(row[1:].numpy(), rated).any()  # never rated, truncation or not


def test_movielens_missing_recbole_says_how_to_install(monkeypatch):
    from freescale_embed.data import movielens

    monkeypatch.setattr(movielens.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ModuleNotFoundError, match=re.escape("pip install --no-deps recbole==1.2.1")
    ):
        movielens.movielens_path()
