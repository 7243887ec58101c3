"""State dicts, TorchRec KJT input, pooling, telemetry and the path through freescale_balance."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from freescale_balance import Balancer, BalancerConfig, JaggedBatch
from freescale_embed import Adam, RowWiseAdagrad, ShardedEmbeddingCollection
from freescale_embed.workload import make_batch
from tests.embed.ranks import TABLES, Case, train
from tests.embed.reference import loss_weights


def _batches(steps: int, seed: int = 7, rate: float | None = 0.2) -> list[JaggedBatch]:
    workload = Case(seed=seed, collision_rate=rate).workload(dist.get_world_size())
    return [make_batch(workload, dist.get_rank(), step) for step in range(steps)]


def _step(emb: ShardedEmbeddingCollection, batches: list, step: int) -> dict:
    if emb.mode == "sync":
        out = emb(batches[step])
    else:
        last = step + 1 == len(batches)
        out = emb(batches[step], None if last else batches[step + 1], final=last)
    values = [o.values for o in out.values()]
    weights = loss_weights(dist.get_rank(), step, [v.shape for v in values])
    sum((v * w).sum() for v, w in zip(values, weights, strict=True)).backward()
    return {k: o.values.detach() for k, o in out.items()}


def resume_from_state(full: bool, mode: str) -> dict[str, int]:
    """Train 6 steps, save, load into a fresh collection, train 6 more: same as never stopping."""
    batches = _batches(12)
    optimizer = Adam(lr=0.05)
    straight = ShardedEmbeddingCollection(TABLES, optimizer=optimizer, mode=mode)
    for step in range(12):
        _step(straight, batches, step)

    first = ShardedEmbeddingCollection(TABLES, optimizer=optimizer, mode=mode)
    for step in range(6):
        _step(first, batches[:6], step)  # its last step is final: nothing left in flight
    saved = first.state_dict(full=full)
    resumed = ShardedEmbeddingCollection(TABLES, optimizer=optimizer, mode=mode, seed=99)
    resumed.load_state_dict(saved)
    for step in range(6, 12):
        _step(resumed, batches, step)

    mine, theirs = straight.state_dict(), resumed.state_dict()
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key
    sizes = {key: int(value.shape[0]) if value.dim() else 0 for key, value in saved.items()}
    for emb in (straight, first, resumed):
        emb.close()
    return sizes


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_save_load_resume_is_exact(local_groups, full):
    # The straight run's step 6 is not final but the resumed run's is a cold start; both are
    # exact, so the tables agree bit for bit (sync mode here; prioritized below).
    sizes = local_groups.get(2).run(resume_from_state, full, "sync")
    if full:
        assert sizes[0]["tables.items.weight"] == 400 == sizes[1]["tables.items.weight"]
        assert sizes[0]["tables.items.exp_avg"] == 400
    else:
        assert sizes[0]["tables.items.weight"] + sizes[1]["tables.items.weight"] == 400
        assert sizes[0]["tables.tiny.weight"] + sizes[1]["tables.tiny.weight"] == 3
    assert sizes[0]["step"] == 0


def test_prioritized_resume_is_exact(local_groups):
    local_groups.get(2).run(resume_from_state, True, "prioritized")


def wrong_shape() -> str:
    emb = ShardedEmbeddingCollection(TABLES)
    state = emb.state_dict()
    state["tables.items.weight"] = torch.zeros(7, 8)
    with pytest.raises(RuntimeError) as error:
        emb.load_state_dict(state)
    emb.close()
    return str(error.value)


def test_loading_a_table_of_another_shape_fails_clearly(local_groups):
    message = local_groups.get(2).run(wrong_shape)[0]
    assert "tables.items.weight" in message and "size mismatch" in message


def kjt_and_pooling() -> bool:
    pytest.importorskip("torchrec")
    batches = _batches(2)
    plain = ShardedEmbeddingCollection(TABLES)
    pooled = ShardedEmbeddingCollection(TABLES, pooling="sum")
    meaned = ShardedEmbeddingCollection(TABLES, pooling="mean")
    with torch.no_grad():
        from_batch = plain(batches[0])
        from_kjt = plain(batches[0].to_keyed_jagged_tensor())
        sums, means = pooled(batches[0]), meaned(batches[0])
    for name, jagged in from_batch.items():
        assert torch.equal(jagged.values, from_kjt[name].values)
        assert torch.equal(jagged.lengths, from_kjt[name].lengths)
        per_sample = torch.split(jagged.values, jagged.lengths.tolist())
        expected = torch.stack([rows.sum(0) for rows in per_sample])
        torch.testing.assert_close(sums[name], expected)
        counts = jagged.lengths.clamp(min=1).float()[:, None]
        torch.testing.assert_close(means[name], expected / counts)
    for emb in (plain, pooled, meaned):
        emb.close()
    return True


def test_keyed_jagged_tensor_input_and_pooling(local_groups):
    assert local_groups.get(2).run(kjt_and_pooling) == [True, True]


def telemetry() -> list[list[dict]]:
    runs = []
    for rate in (0.2, 0.0):
        case = Case(
            optimizer=RowWiseAdagrad(lr=0.1), collision_rate=rate, steps=8, synchronize_after=None
        )
        runs += [train(case, "sync").telemetry, train(case, "prioritized").telemetry]
    # synchronize() between steps applies the pending collision update: its wait counts in the
    # step whose backward started it, not in the next one.
    case = Case(optimizer=RowWiseAdagrad(lr=0.1), collision_rate=0.2, steps=8, synchronize_after=2)
    runs.append(train(case, "prioritized").telemetry)
    return runs


def test_telemetry_reports_collisions_bytes_and_prefetch_memory(local_groups):
    (sync, prioritized, _, no_collisions, synchronized), _ = local_groups.get(2).run(telemetry)
    for record in sync:
        assert record["lookup"] == "sync" and record["collision_pct"] is None
        assert record["exposed_comm_s"] > 0 and record["bytes_sent"] > 0
        assert record["background_comm_s"] == 0 and record["prefetch_bytes"] == 0
        # Counts (with the preflight statuses), IDs, rows, gradients.
        assert len(record["collective_spans"]) == 4
    steady = prioritized[1:-1]  # the first step starts cold, the last one is final
    assert all(r["lookup"] == "prefetched" for r in steady)
    assert all(18 <= r["collision_pct"] <= 28 for r in steady)
    assert all(r["prefetch_bytes"] > 0 and r["background_comm_s"] > 0 for r in steady)
    # The training thread's critical path: the collision gradients (to owners and next-step
    # requesters); with no collisions nothing (the preflight rides on the background routing).
    assert all(len(r["collective_spans"]) == 1 for r in steady)
    assert all(len(r["collective_spans"]) == 0 for r in no_collisions[1:-1])
    assert [len(r["collective_spans"]) for r in synchronized[1:-1]] == [1, 2, 0, 1, 1, 1]
    # Prioritized moves the same rows and gradients, plus who-needs-what bits per ID and the
    # collision rows' optimizer state and extra gradient copies.
    assert sum(r["bytes_sent"] for r in steady) >= sum(r["bytes_sent"] for r in sync[1:-1])


def balanced_training(steps: int) -> dict:
    """Embeddings of balanced batches land on the balancing rank; prioritized stays exact."""
    balancer = Balancer(BalancerConfig(policy="kk", length_feature="history"))
    loaded = _batches(steps)
    moved, plans = zip(*(balancer.shuffle(batch) for batch in loaded), strict=True)
    pooled = ShardedEmbeddingCollection(TABLES, pooling="sum")
    with torch.no_grad():
        here = pooled(loaded[0])
        there = pooled(moved[0])
    for name in here:
        # Each sample's embeddings were looked up on the rank that computes it; sent back, they
        # are exactly those of a lookup where the sample was loaded.
        assert torch.equal(balancer.unshuffle(there[name], plans[0]), here[name])
    runs = {}
    for mode in ("sync", "prioritized"):
        emb = ShardedEmbeddingCollection(TABLES, optimizer=RowWiseAdagrad(lr=0.1), mode=mode)
        runs[mode] = [_step(emb, list(moved), step) for step in range(steps)]
        runs[mode + "_state"] = emb.state_dict()
        emb.close()
    for a, b in zip(runs["sync"], runs["prioritized"], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    for key, value in runs["sync_state"].items():
        assert torch.equal(value, runs["prioritized_state"][key]), key
    pooled.close()
    balancer.close()
    other = 1 - dist.get_rank()
    return sum(int(plan.recv_counts[other]) for plan in plans)


def test_works_on_balanced_batches(local_groups):
    moved_in = local_groups.get(2).run(balanced_training, 6)
    assert sum(moved_in) > 0  # samples did change ranks
