"""Property tests: the references against the oracles on inputs drawn by Hypothesis."""

from __future__ import annotations

import pytest
import torch

from freescale_kernels.ops import reference
from tests.kernels.jagged_cases import (
    Case,
    cpu_equal,
    make_input,
    oracle_combine,
    oracle_dispatch,
    oracle_transpose,
    oracle_unique,
)

pytest.importorskip("hypothesis")

from hypothesis import given, settings
from hypothesis import strategies as st


@st.composite
def cases(draw: st.DrawFn) -> Case:
    return Case(
        "hypothesis",
        num_keys=draw(st.integers(1, 4)),
        batch=draw(st.integers(0, 24)),
        world_size=draw(st.sampled_from([1, 2, 3, 8, 64, 512])),
        dim=draw(st.sampled_from([0, 2])),
        lengths_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        max_length=draw(st.integers(0, 9)),
        empty_fraction=draw(st.sampled_from([0.0, 0.3, 0.9])),
        zero_key=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@given(cases())
@settings(max_examples=40, deadline=None)
def test_dispatch_combine_transpose_match_oracles(case: Case) -> None:
    values, lengths, ranks = make_input(case)
    world, keys = case.world_size, case.num_keys
    sent = reference.ranged_dispatch(values, lengths, ranks, world)
    want = oracle_dispatch(values, lengths, ranks, world)
    assert cpu_equal(sent.values, want[0])
    assert cpu_equal(sent.lengths, want[1])
    assert cpu_equal(sent.rank_splits, want[2])
    assert cpu_equal(sent.key_splits, want[3])
    assert cpu_equal(sent.sample_counts, torch.bincount(ranks.cpu(), minlength=world))
    assert cpu_equal(ranks[sent.order], torch.sort(ranks).values)

    back = reference.ranged_combine(sent.values, sent.lengths, ranks, keys)
    assert cpu_equal(back.values, values) and cpu_equal(back.lengths, lengths)
    oracle_back = oracle_combine(sent.values, sent.lengths, ranks, keys)
    assert cpu_equal(back.values, oracle_back[0])

    # The receiver's view: the same buffer, read as blocks of sample_counts samples per rank.
    counts = sent.sample_counts
    key_major = reference.keyed_transpose(sent.values, sent.lengths, counts, keys)
    want_km = oracle_transpose(sent.values, sent.lengths, counts, keys, True)
    assert cpu_equal(key_major.values, want_km[0])
    assert cpu_equal(key_major.lengths, want_km[1])
    rank_major = reference.keyed_transpose(
        key_major.values, key_major.lengths, counts, keys, to_key_major=False
    )
    want_rm = oracle_transpose(key_major.values, key_major.lengths, counts, keys, False)
    assert cpu_equal(rank_major.values, want_rm[0])
    assert cpu_equal(rank_major.values, sent.values)
    assert cpu_equal(rank_major.lengths, sent.lengths)


@given(st.lists(st.integers(-5, 30), max_size=60))
@settings(max_examples=60, deadline=None)
def test_unique_with_inverse(ids_list: list[int]) -> None:
    ids = torch.tensor(ids_list, dtype=torch.int64)
    result = reference.unique_with_inverse(ids)
    unique, inverse, counts, order = oracle_unique(ids)
    assert result.values.tolist() == unique
    assert result.inverse.tolist() == inverse
    assert result.counts.tolist() == counts
    assert result.order.tolist() == order
    assert result.offsets.tolist() == [
        0,
        *torch.tensor(counts, dtype=torch.int64).cumsum(0).tolist(),
    ]
