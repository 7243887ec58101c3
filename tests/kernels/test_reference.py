"""The PyTorch references against trivially correct Python oracles, and the naive loops."""

from __future__ import annotations

import pytest
import torch

from freescale_kernels.ops import naive, reference
from tests.kernels.jagged_cases import (
    Case,
    cpu_equal,
    make_input,
    oracle_segment_sum,
    oracle_select,
)

CASES = [
    Case("basic"),
    Case("empty-samples", empty_fraction=0.7, seed=1),
    Case("zero-length-key", zero_key=True, seed=2),
    Case("huge-sample", huge_sample=3000, seed=3),
    Case("rows-f32-int32", dim=3, dtype=torch.float32, lengths_dtype=torch.int32, seed=4),
    Case("rows-bf16", dim=2, dtype=torch.bfloat16, seed=5),
    Case("one-rank", world_size=1, seed=6),
    Case("512-ranks", world_size=512, batch=40, seed=7),
    Case("one-key", num_keys=1, world_size=3, seed=8),
    Case("no-samples", batch=0, seed=9),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_jagged_index_select(case: Case) -> None:
    values, lengths, _ = make_input(case)
    indices = torch.randint(0, max(case.batch, 1), (case.batch + 3,)) if case.batch else None
    indices = torch.empty(0, dtype=torch.int64) if indices is None else indices
    out = reference.jagged_index_select(values, lengths, indices.to(values.device))
    want_values, want_lengths = oracle_select(values, lengths, indices)
    assert cpu_equal(out.values, want_values)
    assert cpu_equal(out.lengths, want_lengths)
    assert out.lengths.dtype == lengths.dtype
    single = reference.jagged_index_select(values[: int(lengths[0].sum())], lengths[0], indices)
    assert cpu_equal(single.lengths, want_lengths[0])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_naive_matches_reference(case: Case) -> None:
    values, lengths, ranks = make_input(case)
    world, keys = case.world_size, case.num_keys
    want = reference.ranged_dispatch(values, lengths, ranks, world)
    got = naive.ranged_dispatch(values, lengths, ranks, world)
    for name in want._fields:
        assert cpu_equal(getattr(got, name), getattr(want, name)), name
    back = naive.ranged_combine(want.values, want.lengths, ranks, keys)
    assert cpu_equal(back.values, values) and cpu_equal(back.lengths, lengths)
    for to_key_major in (True, False):
        km = reference.keyed_transpose(
            want.values, want.lengths, want.sample_counts, keys, to_key_major=to_key_major
        )
        got_km = naive.keyed_transpose(
            want.values, want.lengths, want.sample_counts, keys, to_key_major=to_key_major
        )
        assert cpu_equal(got_km.values, km.values) and cpu_equal(got_km.lengths, km.lengths)


# Summation order differs from the float64 oracle's: float32 agrees to rounding only.
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-4},
    torch.bfloat16: {"rtol": 1e-2, "atol": 1e-1},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_segment_sum(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    values = (torch.randn(50, 3, generator=gen) * 10).to(dtype)
    offsets = torch.tensor([0, 0, 7, 7, 30, 49, 50])
    order = torch.randperm(50, generator=gen)
    tolerance = TOLERANCE.get(dtype, {})
    for kwargs in ({}, {"order": order}):
        got = reference.segment_sum(values, offsets, **kwargs)
        assert got.dtype == dtype
        want = oracle_segment_sum(values, offsets, kwargs.get("order"))
        torch.testing.assert_close(got.double(), want.to(dtype).double(), **tolerance)
    ids = torch.repeat_interleave(torch.arange(6), offsets.diff())
    by_ids = reference.segment_sum(values, segment_ids=ids, num_segments=6)
    assert torch.equal(by_ids, reference.segment_sum(values, offsets))


def test_rejects_bad_inputs() -> None:
    values, lengths, ranks = make_input(Case("bad"))
    with pytest.raises(ValueError, match="ranks must be 1-D integers"):
        reference.ranged_dispatch(values, lengths, ranks.float(), 4)
    with pytest.raises(ValueError, match="world_size"):
        reference.ranged_dispatch(values, lengths, ranks, 0)
    with pytest.raises(ValueError, match="lengths must be"):
        reference.ranged_dispatch(values, lengths[None], ranks, 4)
    with pytest.raises(ValueError, match="expected 3 x 17 lengths"):
        reference.ranged_combine(values, lengths[:, 1:], ranks, 3)
    with pytest.raises(ValueError, match="exactly one"):
        reference.segment_sum(values.float(), None)
