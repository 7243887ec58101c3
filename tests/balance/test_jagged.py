"""The shared jagged containers: selection, validation, TorchRec conversion, one class across
packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale_balance import JaggedBatch, JaggedBatchError, JaggedTensor

ROOT = Path(__file__).resolve().parents[2]


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


def test_keyed_form_unpacks_and_counts_samples():
    keyed = JaggedTensor(torch.arange(6), torch.tensor([[2, 0, 1], [1, 2, 0]]))
    values, lengths = keyed
    assert values is keyed.values and lengths is keyed.lengths
    assert keyed.batch_size == 3
    assert keyed.offsets().tolist() == [0, 2, 2, 3, 4, 6, 6]
    assert JaggedTensor(torch.arange(3), torch.tensor([1, 2], dtype=torch.int32)).batch_size == 2


def test_kernels_and_balance_share_one_class():
    fk = pytest.importorskip("freescale_kernels")
    import freescale_balance.jagged

    assert fk.JaggedTensor is JaggedTensor is freescale_balance.jagged.JaggedTensor
    assert fk.layout.JaggedTensor is JaggedTensor
    out = fk.ranged_combine(torch.arange(3), torch.tensor([1, 2]), torch.tensor([0, 0]), 1)
    assert type(out) is JaggedTensor
    with pytest.raises(JaggedBatchError):
        out.validate()  # keyed [1, 2] lengths: validate() is for one run per sample


def test_shared_module_is_a_relative_symlink():
    link = ROOT / "freescale_balance" / "src" / "freescale_balance" / "_jagged.py"
    assert link.is_symlink()
    target = Path(link.readlink())
    assert target.as_posix() == "../../../kernels/src/freescale_kernels/_jagged.py"
    assert link.resolve().is_file()


# freescale_kernels made unimportable, as if not installed.
WITHOUT_KERNELS = """
import sys

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "freescale_kernels":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NotInstalled())
import torch
from freescale_balance import JaggedBatch, JaggedBatchError, JaggedTensor

assert JaggedTensor.__module__ == "freescale_balance._jagged", JaggedTensor.__module__
assert "freescale_kernels" not in sys.modules
feature = JaggedTensor(torch.arange(5), torch.tensor([2, 0, 3]))
assert feature.select(torch.tensor([2, 0])).values.tolist() == [2, 3, 4, 0, 1]
try:
    JaggedBatch({"ids": JaggedTensor(torch.arange(2), torch.tensor([3]))}).validate()
except JaggedBatchError as error:
    assert "sum to 3" in str(error)
else:
    raise AssertionError("validate accepted a bad feature")
"""


def test_balance_works_without_kernels():
    subprocess.run([sys.executable, "-c", WITHOUT_KERNELS], check=True, timeout=120, cwd=ROOT)
