"""Triton kernels against the references, bit for bit, on random jagged inputs.

Without a GPU the kernels run through Triton's interpreter (``conftest.py``), so sizes stay small.
"""

from __future__ import annotations

import pytest
import torch

import freescale_kernels as fk
from freescale_kernels.ops import reference
from freescale_kernels.tiles import TUNED, CopyTile, Tiles
from tests.kernels.jagged_cases import DEVICE, Case, make_input, make_values

pytest.importorskip("triton")

# What a movement returns.
Result = fk.JaggedTensor | fk.Dispatched

CASES = [
    Case("basic"),
    Case("empty-samples", empty_fraction=0.8, seed=1),
    Case("zero-length-key", zero_key=True, seed=2),
    Case("huge-sample", huge_sample=20000, batch=9, seed=3),
    Case("rows-f32-int32", dim=3, dtype=torch.float32, lengths_dtype=torch.int32, seed=4),
    Case("rows-bf16", dim=5, dtype=torch.bfloat16, seed=5),
    Case("bf16-int32", dtype=torch.bfloat16, lengths_dtype=torch.int32, seed=6),
    Case("wide-rows", dim=300, dtype=torch.float32, max_length=2, batch=6, seed=7),
    Case("one-rank", world_size=1, seed=8),
    Case("two-ranks", world_size=2, seed=9),
    Case("64-ranks", world_size=64, batch=50, seed=10),
    Case("512-ranks", world_size=512, batch=40, seed=11),
    Case("one-key", num_keys=1, world_size=3, seed=12),
    Case("no-samples", batch=0, seed=13),
    Case("all-empty", empty_fraction=1.0, seed=14),
]


def assert_same(got: Result, want: Result) -> None:
    assert type(got) is type(want)
    names = ("values", "lengths") if isinstance(want, fk.JaggedTensor) else want._fields
    for name, a, b in zip(names, got, want, strict=True):
        assert a.dtype == b.dtype, name
        assert a.shape == b.shape, name
        assert torch.equal(a, b), name


@pytest.mark.parametrize("case", CASES, ids=str)
def test_jagged_index_select(case: Case) -> None:
    values, lengths, _ = make_input(case)
    gen = torch.Generator().manual_seed(case.seed)
    indices = torch.randint(0, max(case.batch, 1), (case.batch + 3,), generator=gen)
    indices = indices[: case.batch + 3 if case.batch else 0].to(DEVICE)
    want = reference.jagged_index_select(values, lengths, indices)
    assert_same(fk.jagged_index_select(values, lengths, indices, backend="triton"), want)
    # Given offsets (in the lengths' dtype) and output size, and a single key.
    offsets = reference.exclusive_cumsum(lengths.reshape(-1)).to(lengths.dtype)
    given = fk.jagged_index_select(
        values,
        lengths,
        indices.to(torch.int32),
        offsets=offsets,
        output_size=want.values.shape[0],
        backend="triton",
    )
    assert_same(given, want)
    if case.num_keys:
        first = values[: int(lengths[0].sum())]
        single = fk.jagged_index_select(first, lengths[0], indices, backend="triton")
        assert_same(single, reference.jagged_index_select(first, lengths[0], indices))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_dispatch_combine_transpose(case: Case) -> None:
    values, lengths, ranks = make_input(case)
    world, keys = case.world_size, case.num_keys
    want = reference.ranged_dispatch(values, lengths, ranks, world)
    sent = fk.ranged_dispatch(values, lengths, ranks, world, backend="triton")
    assert_same(sent, want)

    back = fk.ranged_combine(sent.values, sent.lengths, ranks, keys, backend="triton")
    assert_same(back, reference.ranged_combine(sent.values, sent.lengths, ranks, keys))
    assert torch.equal(back.values, values) and torch.equal(back.lengths, lengths)

    counts = sent.sample_counts
    for to_key_major in (True, False):
        source = sent if to_key_major else back
        got = fk.keyed_transpose(
            source.values, source.lengths, counts, keys, to_key_major=to_key_major, backend="triton"
        )
        ref = reference.keyed_transpose(
            source.values, source.lengths, counts, keys, to_key_major=to_key_major
        )
        assert_same(got, ref)


def test_dispatch_without_keys() -> None:
    lengths = torch.zeros(0, 5, dtype=torch.int64, device=DEVICE)
    values = torch.zeros(0, device=DEVICE)
    ranks = torch.tensor([2, 0, 1, 2, 2], device=DEVICE)
    sent = fk.ranged_dispatch(values, lengths, ranks, 3, backend="triton")
    assert_same(sent, reference.ranged_dispatch(values, lengths, ranks, 3))


def test_combine_with_rank_gaps() -> None:
    # Ranks 0..6 absent: combine never needs the world size.
    case = Case("gaps", world_size=3, seed=21)
    values, lengths, ranks = make_input(case)
    ranks = ranks * 3 + 7
    sent = reference.ranged_dispatch(values, lengths, ranks, 14)
    back = fk.ranged_combine(sent.values, sent.lengths, ranks, case.num_keys, backend="triton")
    assert torch.equal(back.values, values) and torch.equal(back.lengths, lengths)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_unique_with_inverse(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    for ids in (
        torch.randint(-50, 50, (3000,), generator=gen),
        torch.zeros(17, dtype=torch.int64),
        torch.empty(0, dtype=torch.int64),
        torch.tensor([2**40, -(2**40), 2**40]) if dtype == torch.int64 else torch.arange(9),
    ):
        ids = ids.to(dtype).to(DEVICE)
        assert_same(
            fk.unique_with_inverse(ids, backend="triton"), reference.unique_with_inverse(ids)
        )


@pytest.mark.parametrize(
    ("dtype", "dim"),
    [(torch.float32, 4), (torch.bfloat16, 3), (torch.float64, 0), (torch.int64, 2)],
)
def test_segment_sum(dtype: torch.dtype, dim: int) -> None:
    gen = torch.Generator().manual_seed(3)
    values = make_values(400, dim, dtype, gen).to(DEVICE)
    if not dtype.is_floating_point:
        values = values % 1000
    offsets = torch.tensor([0, 0, 1, 150, 150, 390, 400], device=DEVICE)
    order = torch.randperm(400, generator=gen).to(DEVICE)
    for kwargs in ({}, {"order": order}):
        got = fk.segment_sum(values, offsets, backend="triton", **kwargs)
        want = reference.segment_sum(values, offsets, **kwargs)
        assert got.dtype == want.dtype and got.shape == want.shape
        if dtype == torch.bfloat16:
            torch.testing.assert_close(got, want, rtol=1e-2, atol=0.1)
        else:
            torch.testing.assert_close(got, want)
        again = fk.segment_sum(values, offsets, backend="triton", **kwargs)
        assert torch.equal(got, again)  # bitwise run to run
    ids = torch.repeat_interleave(torch.arange(6, device=DEVICE), offsets.diff())
    by_ids = fk.segment_sum(values, segment_ids=ids, num_segments=6, backend="triton")
    assert torch.equal(by_ids, fk.segment_sum(values, offsets, backend="triton"))


def test_segment_sum_aggregates_unique_ids() -> None:
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 40, (300,), generator=gen).to(DEVICE)
    grads = torch.randn(300, 8, generator=gen).to(DEVICE)
    unique = fk.unique_with_inverse(ids, backend="triton")
    got = fk.segment_sum(grads, unique.offsets, order=unique.order, backend="triton")
    want = torch.zeros(unique.values.numel(), 8, device=DEVICE).index_add_(0, unique.inverse, grads)
    torch.testing.assert_close(got, want)


SMALL_TILE_CASES = [
    Case("tiles-basic", max_length=9, seed=30),
    Case("tiles-huge", huge_sample=300, batch=6, seed=31),
    Case("tiles-rows", dim=3, dtype=torch.bfloat16, empty_fraction=0.5, seed=32),
    Case("tiles-wide", dim=20, dtype=torch.float32, max_length=2, batch=5, seed=33),
]


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny tiles, so that tiles start and end inside runs and span empty runs."""
    from freescale_kernels.ops import dedup, index_select, jagged_copy, ranged

    monkeypatch.setattr(jagged_copy, "_INTERPRETER_TILE_ELEMENTS", 16)
    monkeypatch.setattr(jagged_copy, "_MAX_BLOCK_D", 16)
    for module in (ranged, index_select, dedup):
        monkeypatch.setattr(module, "_INTERPRETER_BLOCK", 16)
    monkeypatch.setattr(dedup, "_INTERPRETER_SUM_TILE_ELEMENTS", 16)
    monkeypatch.setattr(dedup, "_SUM_MAX_BLOCK_D", 8)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="tile sizes are patched for the interpreter")
@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize("case", SMALL_TILE_CASES, ids=str)
def test_small_tiles(case: Case) -> None:
    values, lengths, ranks = make_input(case)
    indices = torch.tensor([3, 1, 1, 0, 4, 2, 3])
    assert_same(
        fk.jagged_index_select(values, lengths, indices, backend="triton"),
        reference.jagged_index_select(values, lengths, indices),
    )
    sent = fk.ranged_dispatch(values, lengths, ranks, case.world_size, backend="triton")
    assert_same(sent, reference.ranged_dispatch(values, lengths, ranks, case.world_size))
    back = fk.ranged_combine(sent.values, sent.lengths, ranks, case.num_keys, backend="triton")
    assert torch.equal(back.values, values) and torch.equal(back.lengths, lengths)
    if values.dtype.is_floating_point:
        leaf = values.detach().requires_grad_()
        out = fk.jagged_index_select(leaf, lengths, indices, backend="triton").values
        out.backward(torch.ones_like(out))
        ref_leaf = values.detach().requires_grad_()
        ref = reference.jagged_index_select(ref_leaf, lengths, indices).values
        ref.backward(torch.ones_like(ref))
        torch.testing.assert_close(leaf.grad, ref_leaf.grad)
        offsets = torch.tensor([0, 5, 5, 6, values.shape[0]])
        torch.testing.assert_close(
            fk.segment_sum(values, offsets, backend="triton"),
            reference.segment_sum(values, offsets),
            rtol=1e-2,
            atol=1e-2,
        )


PLANNER_CASES = [
    Case("planner-basic", seed=40),
    Case("planner-rows-int32", dim=4, dtype=torch.bfloat16, lengths_dtype=torch.int32, seed=41),
    Case("planner-huge", huge_sample=5000, batch=7, world_size=5, seed=42),
    Case("planner-empty", empty_fraction=0.9, world_size=9, seed=43),
]


def _run_all(case: Case, tiles: Tiles = TUNED) -> list[tuple[Result, Result]]:
    """(Triton with ``tiles``, reference) results of every movement on ``case``."""
    values, lengths, ranks = make_input(case)
    world, keys = case.world_size, case.num_keys
    indices = torch.tensor([3, 1, 1, 0, 4, 2, 3], device=DEVICE) % case.batch
    sent = fk.ranged_dispatch(values, lengths, ranks, world, backend="triton", tiles=tiles)
    pairs = [
        (sent, reference.ranged_dispatch(values, lengths, ranks, world)),
        (
            fk.jagged_index_select(values, lengths, indices, backend="triton", tiles=tiles),
            reference.jagged_index_select(values, lengths, indices),
        ),
        (
            fk.ranged_combine(
                sent.values, sent.lengths, ranks, keys, backend="triton", tiles=tiles
            ),
            reference.ranged_combine(sent.values, sent.lengths, ranks, keys),
        ),
    ]
    for to_key_major in (True, False):
        source_values, source_lengths = (
            (sent.values, sent.lengths) if to_key_major else (values, lengths)
        )
        pairs.append(
            (
                fk.keyed_transpose(
                    source_values,
                    source_lengths,
                    sent.sample_counts,
                    keys,
                    to_key_major=to_key_major,
                    backend="triton",
                    tiles=tiles,
                ),
                reference.keyed_transpose(
                    source_values,
                    source_lengths,
                    sent.sample_counts,
                    keys,
                    to_key_major=to_key_major,
                ),
            )
        )
    return pairs


@pytest.mark.parametrize("case", PLANNER_CASES, ids=str)
def test_fused_planner_is_used(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    from freescale_kernels.ops import index_select, ranged

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the multi-launch planner ran")

    monkeypatch.setattr(ranged, "_plan", forbidden)
    monkeypatch.setattr(index_select, "_select_plan_kernel", forbidden)
    for got, want in _run_all(case):
        assert_same(got, want)


@pytest.mark.parametrize("lanes", [0, 4, 128])
@pytest.mark.parametrize("case", [*PLANNER_CASES[:2], SMALL_TILE_CASES[1]], ids=str)
def test_copy_wide_search(case: Case, lanes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The copy's run search, binary (0) or with several probes per round (tiny tiles in the
    # interpreter, so that tiles start and end inside runs and span many).
    from freescale_kernels.ops import jagged_copy

    if DEVICE.type != "cuda":
        monkeypatch.setattr(jagged_copy, "_INTERPRETER_TILE_ELEMENTS", 16)
    for got, want in _run_all(case, Tiles(copy=CopyTile(search_lanes=lanes))):
        assert_same(got, want)


@pytest.mark.parametrize("case", PLANNER_CASES, ids=str)
def test_multi_launch_planner(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    from freescale_kernels.ops import index_select, ranged

    monkeypatch.setattr(ranged, "_FUSED_MAX_SAMPLES", 0)
    monkeypatch.setattr(index_select, "_FUSED_MAX_KEYS", 0)
    for got, want in _run_all(case):
        assert_same(got, want)


@pytest.mark.parametrize(
    ("world_size", "dtype"), [(200, torch.uint8), (3000, torch.int16), (40000, torch.int32)]
)
def test_ranks_sort_narrow(world_size: int, dtype: torch.dtype) -> None:
    from freescale_kernels.ops import ranged

    gen = torch.Generator().manual_seed(world_size)
    ranks = torch.randint(0, world_size, (300,), generator=gen).to(DEVICE)
    sorted_ranks, order = ranged.sort_ranks(ranks, world_size)
    want_sorted, want_order = torch.sort(ranks, stable=True)
    assert sorted_ranks.dtype == dtype
    assert torch.equal(order, want_order) and torch.equal(sorted_ranks.to(torch.int64), want_sorted)
    case = Case("narrow", world_size=world_size, batch=60, seed=46)
    values, lengths, ranks = make_input(case)
    sent = fk.ranged_dispatch(values, lengths, ranks, world_size, backend="triton")
    assert_same(sent, reference.ranged_dispatch(values, lengths, ranks, world_size))


def test_fused_planner_int64_sums() -> None:
    # Past 2**31 rows the fused planner sums in int64; the plan must not change.
    from freescale_kernels.ops import ranged

    values, lengths, ranks = make_input(Case("int64-sums", world_size=6, seed=44))
    small = ranged.plan_dispatch(lengths, ranks, 6, values.shape[0])
    large = ranged.plan_dispatch(lengths, ranks, 6, 2**31)
    for a, b in zip(small[0], large[0], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(small[1:], large[1:], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("dtype", "dim", "word"),
    [
        (torch.bfloat16, 128, torch.int64),
        (torch.bfloat16, 6, torch.int32),
        (torch.float16, 3, torch.float16),
        (torch.int8, 2, torch.int16),
        (torch.float32, 1, torch.float32),
    ],
)
def test_rows_move_as_words(dtype: torch.dtype, dim: int, word: torch.dtype) -> None:
    from freescale_kernels.ops.jagged_copy import as_words

    rows = torch.zeros(5, dim, dtype=dtype, device=DEVICE)
    assert as_words(rows).dtype == word
    assert torch.equal(as_words(rows).view(dtype), rows)
    case = Case("words", dim=dim, dtype=dtype if dtype != torch.int8 else torch.int64, seed=45)
    values, lengths, ranks = make_input(case)
    if dtype == torch.int8:
        values = (values % 100).to(torch.int8)
    sent = fk.ranged_dispatch(values, lengths, ranks, case.world_size, backend="triton")
    assert_same(sent, reference.ranged_dispatch(values, lengths, ranks, case.world_size))
