"""SASRec over a sharded item table (a world of one over Gloo), its jagged attention and the
ranking metrics."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from freescale_balance import JaggedBatch, JaggedTensor
from freescale_embed import Adam, Optimizer, RowWiseAdagrad, ShardedEmbeddingCollection
from freescale_embed.data import (
    SyntheticConfig,
    synthetic_batches,
    synthetic_eval_batches,
    synthetic_item_counts,
)
from freescale_embed.metrics import hit_rate_and_ndcg, popularity_scores
from freescale_embed.models import (
    SASRec,
    SASRecConfig,
    fixed_width,
    item_tables,
    jagged_causal_attention,
    jagged_causal_attention_torch,
    jagged_causal_attention_varlen,
    target_counts,
)

DATA = SyntheticConfig(
    num_users=128, num_items=300, max_history=48, global_batch_size=8, num_negatives=16
)
MODEL = SASRecConfig(num_items=300, embedding_dim=16, num_heads=2, max_length=48)
# Samples computed alone or in another batch differ by float rounding only: the dense layers'
# matrix products may block differently for another number of rows.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module", autouse=True)
def world_of_one() -> Iterator[None]:
    # Ops this small gain nothing from intra-op threads, and on a busy 2-core machine the
    # threads' spin-waits made the training test 7x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    torch.set_num_threads(threads)


def build(
    config: SASRecConfig = MODEL, seed: int = 0, optimizer: Optimizer | None = None
) -> SASRec:
    torch.manual_seed(seed)
    tables = item_tables(config)
    return SASRec(config, ShardedEmbeddingCollection(tables, optimizer=optimizer, seed=seed))


def batches(config: SyntheticConfig = DATA, steps: int = 2) -> list[JaggedBatch]:
    return list(itertools.islice(synthetic_batches(config, 0, 1), steps))


def test_losses_do_not_depend_on_the_rest_of_the_batch():
    model = build()
    batch = batches()[0]
    with torch.no_grad():
        together = model(batch)
        alone = torch.cat([model(batch.select(torch.tensor([i]))) for i in range(8)])
        order = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4])
        shuffled = model(batch.select(order))
    assert together.shape == (8,) and together.dtype == torch.float32
    torch.testing.assert_close(alone, together, **TOLERANCE)
    torch.testing.assert_close(shuffled, together[order], **TOLERANCE)
    assert torch.equal(target_counts(batch), batch.features["history"].lengths - 1)


def reference_losses(model: SASRec, batch: JaggedBatch) -> torch.Tensor:
    """The loss position by position, from the hidden states of whole histories."""
    weights = model.embeddings.state_dict(full=True)["tables.items.weight"]
    history = batch.features["history"]
    negatives = fixed_width(batch.features["negatives"], "negatives")
    offsets = history.offsets().tolist()
    losses = []
    for b in range(batch.batch_size):
        ids = history.values[offsets[b] : offsets[b + 1]]
        hidden = model.encode(weights[ids], torch.tensor([ids.numel()]))
        total = torch.zeros(())
        for i in range(ids.numel() - 1):
            logits = [hidden[i] @ weights[ids[i + 1]]]
            logits += [
                hidden[i] @ weights[n] if n != ids[i + 1] else torch.tensor(-math.inf)
                for n in negatives[b]
            ]
            total = total - torch.log_softmax(torch.stack(logits), 0)[0]
        losses.append(total)
    return torch.stack(losses)


def test_loss_is_the_sampled_softmax_of_each_position():
    model = build()
    batch = batches()[0]
    # Make some negatives collide with the next item, which must then be masked out.
    history = batch.features["history"]
    negatives = batch.features["negatives"].values.clone().view(8, -1)
    negatives[:, 0] = history.values[history.offsets()[:-1] + 1]
    batch = JaggedBatch(
        {**batch.features, "negatives": JaggedTensor(negatives.view(-1), torch.full((8,), 16))},
        batch.dense,
    )
    with torch.no_grad():
        torch.testing.assert_close(model(batch), reference_losses(model, batch), **TOLERANCE)


def test_attention_is_causal():
    model = build()
    items = torch.randn(30, 16)
    changed = items.clone()
    changed[12] += torch.randn(16)  # a constant shift would vanish in the LayerNorms
    lengths = torch.tensor([30])
    with torch.no_grad():
        before, after = model.encode(items, lengths), model.encode(changed, lengths)
    torch.testing.assert_close(before[:12], after[:12], rtol=0, atol=1e-6)
    assert (before[12:] - after[12:]).abs().amax(1).min() > 1e-4


def empty_batch() -> JaggedBatch:
    nothing = torch.zeros(0, dtype=torch.int64)
    return JaggedBatch(
        {"history": JaggedTensor(nothing, nothing), "negatives": JaggedTensor(nothing, nothing)},
        {"sample_id": nothing},
    )


def test_empty_batch_runs_forward_and_backward():
    model = build(optimizer=RowWiseAdagrad(lr=0.1))
    emb = model.embeddings
    before = emb.state_dict()["tables.items.weight"].clone()
    losses = model(empty_batch())
    assert losses.shape == (0,) and losses.grad_fn is not None
    losses.sum().backward()
    assert int(emb.step) == 1  # the collection's backward ran
    assert torch.equal(emb.state_dict()["tables.items.weight"], before)
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        assert not parameter.grad.any(), name
    model(batches()[0]).sum().backward()  # the collection goes on
    assert int(emb.step) == 2


def test_gradients_reach_every_dense_parameter_and_the_table():
    model = build(optimizer=Adam(lr=0.01))
    emb = model.embeddings
    before = emb.state_dict()["tables.items.weight"].clone()
    model(batches()[0]).sum().backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
    assert not torch.equal(emb.state_dict()["tables.items.weight"], before)
    assert all(p.requires_grad for p in model.parameters())
    assert not list(model.embeddings.parameters())  # the table is buffers, DDP ignores them


def test_initialisation_is_deterministic():
    first, second = build(seed=3), build(seed=3)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_score_reads_the_whole_table():
    model = build()
    weights = model.embeddings.state_dict(full=True)["tables.items.weight"]
    batch = next(synthetic_eval_batches(DATA, 0, 1, batch_size=5))
    scores = model.score(batch, weights)
    assert scores.shape == (5, 101) and scores.grad_fn is None
    history = batch.features["history"]
    end = int(history.lengths[0])
    hidden = model.encode(weights[history.values[:end]], history.lengths[:1])[-1]
    candidates = fixed_width(batch.features["candidates"], "candidates")
    torch.testing.assert_close(scores[0], weights[candidates[0]] @ hidden, **TOLERANCE)


def test_config_and_table_are_checked():
    with pytest.raises(ValueError, match="must divide"):
        SASRecConfig(num_items=10, embedding_dim=10, num_heads=3)
    assert item_tables(MODEL)[0].feature_names == ("history", "negatives")
    wrong = ShardedEmbeddingCollection(item_tables(dataclasses.replace(MODEL, num_items=301)))
    with pytest.raises(ValueError, match="300 x 16"):
        SASRec(MODEL, wrong)
    model = build(dataclasses.replace(MODEL, max_length=8))
    with pytest.raises(ValueError, match="exceeds max_length"):
        model.encode(torch.zeros(9, 16), torch.tensor([9]))


# -- attention -----------------------------------------------------------------------------------


def padded_reference(q, k, v, lengths):
    """Every sample padded to the longest, with a causal and a padding mask."""
    batch, longest = len(lengths), max(lengths)
    heads, dim = q.shape[1:]
    mask = torch.zeros(batch, longest, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True

    def pad(x):
        out = x.new_zeros(batch, longest, heads, dim)
        out[mask] = x
        return out.transpose(1, 2)

    scores = pad(q) @ pad(k).transpose(-1, -2) / math.sqrt(dim)
    allowed = torch.ones(longest, longest).tril().bool() & mask[:, None, None, :]
    weights = scores.masked_fill(~allowed, -math.inf).softmax(-1).nan_to_num()
    return (weights @ pad(v)).transpose(1, 2)[mask]


def test_jagged_attention_equals_padded_masked_attention():
    torch.manual_seed(0)
    lengths = [5, 1, 12, 0, 7]
    q, k, v = torch.randn(3, sum(lengths), 2, 8).unbind(0)
    offsets = torch.tensor([0, *itertools.accumulate(lengths)])
    out = jagged_causal_attention_torch(q, k, v, offsets, max(lengths))
    torch.testing.assert_close(out, padded_reference(q, k, v, lengths), rtol=1e-5, atol=1e-6)
    assert torch.equal(jagged_causal_attention(q, k, v, offsets, max(lengths)), out)  # CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_varlen_attention_matches_the_torch_path():
    torch.manual_seed(0)
    lengths = [5, 1, 300, 7, 64]
    q, k, v = torch.randn(3, sum(lengths), 2, 32, device="cuda").unbind(0)
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda")
    expected = jagged_causal_attention_torch(q, k, v, offsets, max(lengths))
    out = jagged_causal_attention_varlen(q, k, v, offsets, max(lengths))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


# -- metrics -------------------------------------------------------------------------------------


def test_hit_rate_and_ndcg_on_hand_made_scores():
    scores = torch.tensor(
        [
            [5.0, 1.0, 2.0, 3.0],  # rank 0
            [1.0, 5.0, 2.0, 0.0],  # rank 2
            [2.0, 2.0, 1.0, 2.0],  # ranks 0..2 equally likely (two ties)
            [0.0, 1.0, 1.0, 1.0],  # rank 3
        ]
    )
    hits, ndcg = hit_rate_and_ndcg(scores, k=3)
    torch.testing.assert_close(hits, torch.tensor([1.0, 1.0, 1.0, 0.0]))
    gain = [1 / math.log2(r + 2) for r in range(3)]
    torch.testing.assert_close(ndcg, torch.tensor([1.0, gain[2], sum(gain) / 3, 0.0]))
    hits, ndcg = hit_rate_and_ndcg(scores, k=2)
    torch.testing.assert_close(hits, torch.tensor([1.0, 0.0, 2 / 3, 0.0]))
    torch.testing.assert_close(ndcg, torch.tensor([1.0, 0.0, (gain[0] + gain[1]) / 3, 0.0]))


def test_popularity_scores_are_training_counts():
    candidates = torch.tensor([[2, 0, 1], [1, 1, 3]])
    counts = torch.tensor([7, 0, 3, 1])
    scores = popularity_scores(candidates, counts)
    assert torch.equal(scores, torch.tensor([[3.0, 7.0, 0.0], [0.0, 0.0, 1.0]]))
    hits, _ = hit_rate_and_ndcg(scores, k=2)
    torch.testing.assert_close(hits, torch.tensor([1.0, 0.5]))  # the second: rank 1 or 2


# -- training ------------------------------------------------------------------------------------


def test_training_beats_the_popularity_ranker():
    data = SyntheticConfig(
        num_users=2048,
        num_items=500,
        max_history=30,
        global_batch_size=32,
        num_negatives=64,
        num_steps=150,
        num_eval_users=512,
    )
    config = SASRecConfig(
        num_items=500, embedding_dim=32, num_layers=1, num_heads=1, max_length=30, ffn_multiplier=2
    )
    torch.manual_seed(0)
    emb = ShardedEmbeddingCollection(item_tables(config), optimizer=RowWiseAdagrad(lr=0.1))
    model = SASRec(config, emb)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    curve = []
    for batch in synthetic_batches(data, 0, 1):
        loss = model(batch).sum() / target_counts(batch).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        curve.append(loss.item())
    assert sum(curve[-20:]) < 0.6 * sum(curve[:20])
    weights = emb.state_dict(full=True)["tables.items.weight"]
    counts = synthetic_item_counts(data)
    model_hits, popular_hits = [], []
    for batch in synthetic_eval_batches(data, 0, 1, batch_size=256):
        model_hits.append(hit_rate_and_ndcg(model.score(batch, weights))[0])
        candidates = fixed_width(batch.features["candidates"], "candidates")
        popular_hits.append(hit_rate_and_ndcg(popularity_scores(candidates, counts))[0])
    model_hr, popular_hr = torch.cat(model_hits).mean(), torch.cat(popular_hits).mean()
    assert model_hr > popular_hr + 0.1, (model_hr, popular_hr)
