"""Single-process contracts the exactness of prioritized mode rests on."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale_embed import SGD, Adam, RowWiseAdagrad, TableConfig
from freescale_embed._ops import (
    indices_and_values,
    isin_sorted,
    pack_by_peer,
    peer_numel,
    row_sum,
    segment_sum,
    segment_sum_pairwise,
    unique_with_inverse,
    unpack_by_peer,
)
from freescale_embed.collision_plan import _merge_positions, pack_bits, unpack_bits
from freescale_embed.optim import initial_state
from freescale_embed.sharding import RowShard
from freescale_embed.workload import WorkloadConfig, make_batch, row_set


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 300),
    width=st.sampled_from([1, 3, 8, 64]),
    segments=st.integers(1, 40),
    seed=st.integers(0, 10_000),
    threads=st.sampled_from([1, 2]),
)
def test_segment_sum_adds_each_segment_in_input_order(rows, width, segments, seed, threads):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, width, generator=generator) * 10 ** torch.randint(
        -3, 4, (rows, 1), generator=generator
    )
    ids = torch.randint(0, segments, (rows,), generator=generator)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = segment_sum(values, ids, segments)
    finally:
        torch.set_num_threads(previous)
    expected = torch.zeros(segments, width)
    for i in range(rows):  # the documented order, one addition at a time
        expected[ids[i]] = expected[ids[i]] + values[i]
    assert torch.equal(got, expected)
    # A segment's result does not depend on the other segments (what splitting rows relies on).
    keep = ids % 2 == 0
    assert torch.equal(segment_sum(values[keep], ids[keep], segments)[::2], got[::2])


@pytest.mark.parametrize("width", [1, 5, 8, 13, 64])
def test_row_sum_is_per_row_and_close_to_sum(width):
    values = torch.randn(257, width, dtype=torch.float32) * 1e3
    whole = row_sum(values)
    for i in (0, 100, 256):
        assert torch.equal(row_sum(values[i : i + 1]), whole[i : i + 1])
    torch.testing.assert_close(whole, values.double().sum(1).float(), rtol=1e-5, atol=1e-2)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_pack_then_unpack_is_the_identity(data):
    world = data.draw(st.integers(1, 5))
    shapes = data.draw(st.lists(st.sampled_from([(), (1,), (3,), (8,)]), min_size=1, max_size=4))
    counts = torch.tensor(
        data.draw(
            st.lists(
                st.lists(st.integers(0, 4), min_size=len(shapes), max_size=len(shapes)),
                min_size=world,
                max_size=world,
            )
        ),
        dtype=torch.int64,
    ).reshape(world, len(shapes))
    parts = [torch.randn(int(counts[:, j].sum()), *shape) for j, shape in enumerate(shapes)]
    buffer = pack_by_peer(parts, counts.tolist())
    row_numel = [max(1, int(torch.tensor(shape).prod())) if shape else 1 for shape in shapes]
    assert buffer.numel() == sum(peer_numel(counts.tolist(), row_numel))
    for got, part in zip(unpack_by_peer(buffer, counts.tolist(), shapes), parts, strict=True):
        assert torch.equal(got, part)


def test_unique_with_inverse_is_sorted():
    unique, inverse, _ = unique_with_inverse(torch.tensor([7, 1, 7, 3, 1]))
    assert unique.tolist() == [1, 3, 7]
    assert torch.equal(unique[inverse], torch.tensor([7, 1, 7, 3, 1]))


@pytest.mark.parametrize("optimizer", [SGD(lr=0.3), RowWiseAdagrad(lr=0.3), Adam(lr=0.3)])
def test_updating_rows_together_or_apart_gives_the_same_bits(optimizer):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 13, generator=generator)
    state = initial_state(optimizer, 50, 13, torch.float32)
    rows = torch.randperm(50, generator=generator)[:31]
    for step in (1, 2, 3):
        grads = torch.randn(31, 13, generator=generator)
        together_w, together_s = weight.clone(), {k: v.clone() for k, v in state.items()}
        optimizer.update(together_w, together_s, rows, grads, step)
        for part in (slice(0, 7), slice(7, 8), slice(8, 31)):  # collision rows first, then rest
            optimizer.update(weight, state, rows[part], grads[part], step)
        assert torch.equal(weight, together_w)
        for name in state:
            assert torch.equal(state[name], together_s[name])


def test_sgd_and_adagrad_follow_their_formulas():
    weight, rows = torch.ones(4, 2), torch.tensor([1, 3])
    grads = torch.tensor([[1.0, 3.0], [2.0, 2.0]])
    SGD(lr=0.5).update(weight, {}, rows, grads, 1)
    assert weight.tolist() == [[1, 1], [0.5, -0.5], [1, 1], [0, 0]]
    weight, state = torch.zeros(4, 2), {"momentum1": torch.zeros(4)}
    RowWiseAdagrad(lr=1.0, eps=0.0).update(weight, state, rows, grads, 1)
    assert state["momentum1"].tolist() == [0, 5, 0, 4]
    torch.testing.assert_close(weight[1], -grads[0] / 5**0.5)


@pytest.mark.parametrize("rows", [1, 3, 7, 10, 4097, 10_001])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shards_tile_the_table_and_start_the_same_for_any_world(rows, world):
    table = TableConfig("t", rows, 3, ["f"])
    shards = [RowShard(table, world, rank) for rank in range(world)]
    assert shards[0].start == 0 and shards[-1].end == rows
    for a, b in itertools.pairwise(shards):
        assert a.end == b.start
    ids = torch.arange(rows)
    owners = shards[0].owners(ids)
    for rank, shard in enumerate(shards):
        assert torch.equal(ids[owners == rank], torch.arange(shard.start, shard.end))
    whole = RowShard(table, 1, 0).initial_weight(5, 2, torch.float32)
    pieces = torch.cat([s.initial_weight(5, 2, torch.float32) for s in shards])
    assert torch.equal(whole, pieces)


@pytest.mark.parametrize("rate", [0.0, 0.05, 0.3, 1.0])
def test_workload_collision_rate_is_exact(rate):
    table = TableConfig("t", 5000, 4, ["a", "b"])
    config = WorkloadConfig((table,), world_size=3, rows_per_step=200, collision_rate=rate)
    for step in range(1, 6):
        now, before = row_set(config, 0, step), row_set(config, 0, step - 1)
        assert now.unique().numel() == 200
        assert int(torch.isin(now, before).sum()) == round(rate * 200)
        seen = torch.cat(
            [
                torch.cat([f.values for f in make_batch(config, rank, step).features.values()])
                for rank in range(3)
            ]
        )
        assert torch.equal(seen.unique(), now.sort().values)


def _pairwise_reference(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """The documented tree of one segment: rows 2j and 2j+1 of a level make row j of the next."""
    if not rows:
        return torch.zeros(width)
    while len(rows) > 1:
        rows = [
            rows[i] + rows[i + 1] if i + 1 < len(rows) else rows[i] for i in range(0, len(rows), 2)
        ]
    return rows[0]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 300),
    width=st.sampled_from([1, 3, 8]),
    segments=st.integers(1, 40),
    hot=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_pairwise_segment_sum_is_a_fixed_tree_per_segment(rows, width, segments, hot, seed):
    # The CUDA path's segment sum, run on CPU: its contract does not depend on the device.
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, width, generator=generator) * 10 ** torch.randint(
        -3, 4, (rows, 1), generator=generator
    )
    ids = torch.randint(0, segments, (rows,), generator=generator)
    if hot:  # one ID holds most occurrences, as Zipf traffic's hottest row does
        ids[torch.rand(rows, generator=generator) < 0.7] = segments - 1
    got = segment_sum_pairwise(values, ids, segments)
    for s in range(segments):
        expected = _pairwise_reference(list(values[ids == s]), width)
        assert torch.equal(got[s], expected), s
    keep = ids % 2 == 0
    assert torch.equal(segment_sum_pairwise(values[keep], ids[keep], segments)[::2], got[::2])
    # A bound on the segment sizes (no read of the largest) only adds levels that add nothing.
    largest = int(torch.bincount(ids, minlength=segments).max()) if rows else 0
    for bound in (largest, largest + 5, 4 * largest + 1):
        assert torch.equal(segment_sum_pairwise(values, ids, segments, bound), got)
    torch.testing.assert_close(
        got,
        segment_sum(values, ids, segments),
        rtol=1e-5,
        atol=1e-5 * float(values.abs().sum(0).max()) if rows else 0.0,
    )


@pytest.mark.parametrize("world", [1, 2, 7, 8, 9, 64, 130])
def test_rank_bits_round_trip(world):
    matrix = torch.rand(33, world, generator=torch.Generator().manual_seed(world)) < 0.3
    packed = pack_bits(matrix)
    assert packed.dtype == torch.uint8 and packed.shape == (33, -(-world // 8))
    assert torch.equal(unpack_bits(packed, world), matrix)
    assert unpack_bits(pack_bits(matrix[:0]), world).shape == (0, world)


def test_pairwise_segment_sum_of_no_rows_stays_in_the_autograd_graph():
    # A rank whose features are all empty must still run its backward (and its collectives).
    values = torch.zeros(0, 3, requires_grad=True)
    summed = segment_sum_pairwise(values, torch.zeros(0, dtype=torch.int64), 2)
    assert torch.equal(summed, torch.zeros(2, 3)) and summed.grad_fn is not None
    summed.sum().backward()
    assert values.grad is not None and values.grad.shape == (0, 3)


@settings(max_examples=60, deadline=None)
@given(
    elements=st.lists(st.integers(-5, 60), max_size=40),
    test=st.sets(st.integers(-5, 60), max_size=40),
)
def test_isin_sorted_matches_isin(elements, test):
    elements_t = torch.tensor(elements, dtype=torch.int64)
    test_t = torch.tensor(sorted(test), dtype=torch.int64)
    assert torch.equal(isin_sorted(elements_t, test_t), torch.isin(elements_t, test_t))


@settings(max_examples=60, deadline=None)
@given(
    first=st.sets(st.integers(0, 80), max_size=30), second=st.sets(st.integers(0, 80), max_size=30)
)
def test_merge_positions_orders_the_union_like_unique(first, second):
    first_t = torch.tensor(sorted(first), dtype=torch.int64)
    second_t = torch.tensor(sorted(second), dtype=torch.int64)
    at_first, at_second = _merge_positions(first_t, second_t)
    union = sorted(first | second)
    # The same ID gets the same position, and positions rank IDs as the sorted union does.
    by_position = dict(zip(at_first.tolist(), sorted(first), strict=True)) | dict(
        zip(at_second.tolist(), sorted(second), strict=True)
    )
    assert len(by_position) == len(union)
    assert [by_position[p] for p in sorted(by_position)] == union
    shared = {x: p for x, p in zip(sorted(first), at_first.tolist(), strict=True)}
    for x, p in zip(sorted(second), at_second.tolist(), strict=True):
        assert shared.get(x, p) == p
    assert all(p < len(first) + len(second) for p in by_position)


def test_indices_and_values_reads_masks_and_values():
    masks = [torch.tensor([False, True, True]), torch.zeros(0, dtype=torch.bool)]
    found, values = indices_and_values(masks, [torch.tensor([[1, 2], [3, 4]]), torch.tensor([5])])
    assert [f.tolist() for f in found] == [[1, 2], []]
    assert values == [[[1, 2], [3, 4]], [5]]
