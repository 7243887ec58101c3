"""The shared jagged containers: selection, validation, TorchRec conversion (pure logic)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale_balance import JaggedBatch, JaggedBatchError, JaggedTensor


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 6), min_size=0, max_size=20),
    st.data(),
)
def test_select_matches_a_per_sample_oracle(lengths, data):
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    values = torch.arange(int(lengths_t.sum()) * 2).reshape(-1, 2)
    jagged = JaggedTensor(values, lengths_t)
    indices = data.draw(st.lists(st.integers(0, max(len(lengths) - 1, 0)), max_size=30))
    indices = indices if lengths else []
    picked = jagged.select(torch.tensor(indices, dtype=torch.int64))
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    expected = [values[starts[i] : starts[i] + lengths[i]] for i in indices]
    assert torch.equal(picked.values, torch.cat(expected) if expected else values[:0])
    assert picked.lengths.tolist() == [lengths[i] for i in indices]


@pytest.mark.parametrize(
    "feature, message",
    [
        (JaggedTensor(torch.arange(3), torch.tensor([1, -1, 3])), "sample 1 is negative"),
        (JaggedTensor(torch.arange(3), torch.tensor([1.0, 2.0])), "integer tensor"),
        (JaggedTensor(torch.arange(4), torch.tensor([1, 2])), "sum to 3 but values hold 4"),
        (JaggedTensor(torch.arange(3), torch.tensor([[1, 2]])), "1-D"),
    ],
)
def test_validate_names_the_problem(feature, message):
    with pytest.raises(JaggedBatchError, match=message):
        JaggedBatch(features={"ids": feature}).validate()


def test_batch_checks_sizes_and_schema_digest_tracks_dtypes():
    ids = JaggedTensor(torch.arange(3), torch.tensor([1, 2]))
    with pytest.raises(JaggedBatchError, match="dense field 'label'"):
        JaggedBatch({"ids": ids}, {"label": torch.zeros(3)}).validate()
    a = JaggedBatch({"ids": ids}, {"label": torch.zeros(2)})
    b = JaggedBatch({"ids": ids}, {"label": torch.zeros(2, dtype=torch.float64)})
    assert a.schema_digest() != b.schema_digest()
    assert a.schema_digest() == JaggedBatch({"ids": ids}, {"label": torch.ones(2)}).schema_digest()


def test_round_trip_through_torchrec_keyed_jagged_tensor():
    pytest.importorskip("torchrec")
    batch = JaggedBatch(
        features={
            "a": JaggedTensor(torch.arange(5), torch.tensor([2, 0, 3])),
            "b": JaggedTensor(torch.arange(10, 12), torch.tensor([1, 1, 0])),
        },
        dense={"label": torch.tensor([1.0, 0.0, 1.0])},
    )
    kjt = batch.to_keyed_jagged_tensor()
    assert kjt.keys() == ["a", "b"]
    back = JaggedBatch.from_keyed_jagged_tensor(kjt, dense=batch.dense)
    assert back.equal(batch)
