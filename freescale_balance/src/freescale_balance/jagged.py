"""The jagged batch the components share: ``JaggedBatch`` over ``JaggedTensor`` features.

A batch is ``batch_size`` samples. Each sample has, per feature, a variable-length run of values
(a user history of item IDs, timestamps, ...) and, per dense field, one fixed-shape row (label,
candidate count, dense features). Values of one feature are stored concatenated in sample order
with a ``lengths`` tensor, the layout of TorchRec's ``JaggedTensor``; a batch converts to and from
TorchRec's ``KeyedJaggedTensor`` when TorchRec is installed, without requiring it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


try:
    # One class, not two copies: with freescale-kernels installed, balance takes the shared
    # module from kernels (the optional dependency's direction), so freescale_balance.JaggedTensor
    # is freescale_kernels.JaggedTensor; without it (or with a kernels release that predates the
    # module), balance imports its own link to the same file.
    from freescale_kernels._jagged import JaggedBatchError, JaggedTensor
except ModuleNotFoundError as missing:
    if missing.name not in ("freescale_kernels", "freescale_kernels._jagged"):
        raise
    from freescale_balance._jagged import JaggedBatchError, JaggedTensor

__all__ = ["JaggedBatch", "JaggedBatchError", "JaggedTensor"]


@dataclass(frozen=True)
class JaggedBatch:
    """A batch of samples: jagged features plus per-sample dense fields.

    Args:
        features: feature name -> ``JaggedTensor`` over the batch's samples.
        dense: field name -> tensor whose first dimension is the batch (labels, candidate counts,
            dense features, per-sample outputs).

    Example (2 samples, one feature, one label per sample)::

        JaggedBatch(
            features={"item_ids": JaggedTensor(torch.tensor([7, 8, 9]), torch.tensor([2, 1]))},
            dense={"label": torch.tensor([1.0, 0.0])},
        )
    """

    features: Mapping[str, JaggedTensor] = field(default_factory=dict)
    dense: Mapping[str, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        for feature in self.features.values():
            return feature.batch_size
        for tensor in self.dense.values():
            return int(tensor.shape[0])
        return 0

    def validate(self) -> None:
        """Raises ``JaggedBatchError`` naming the field at fault unless the batch is well formed."""
        if not self.features and not self.dense:
            raise JaggedBatchError("a batch needs at least one feature or dense field")
        size = self.batch_size
        for name, feature in self.features.items():
            feature.validate(f"feature {name!r}")
            if feature.batch_size != size:
                raise JaggedBatchError(
                    f"feature {name!r} has {feature.batch_size} samples, the batch has {size}"
                )
        for name, tensor in self.dense.items():
            if tensor.dim() < 1 or tensor.shape[0] != size:
                raise JaggedBatchError(
                    f"dense field {name!r} has shape {tuple(tensor.shape)}; its first dimension "
                    f"must be the batch size {size}"
                )

    def schema(self) -> tuple[tuple[str, ...], ...]:
        """What must agree across ranks for samples to move between them: names, dtypes, shapes."""
        rows = [
            (
                "feature",
                name,
                str(f.values.dtype),
                str(tuple(f.values.shape[1:])),
                str(f.lengths.dtype),
            )
            for name, f in self.features.items()
        ]
        rows += [
            ("dense", name, str(t.dtype), str(tuple(t.shape[1:])), "")
            for name, t in self.dense.items()
        ]
        return tuple(rows)

    def schema_digest(self) -> int:
        """A 63-bit digest of ``schema()``, cheap to compare across ranks in one collective."""
        digest = hashlib.blake2b(repr(self.schema()).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1

    def select(self, indices: torch.Tensor) -> JaggedBatch:
        """The samples at ``indices``, in that order."""
        indices = indices.to(torch.int64)
        return JaggedBatch(
            features={name: f.select(indices) for name, f in self.features.items()},
            dense={name: t[indices] for name, t in self.dense.items()},
        )

    def equal(self, other: JaggedBatch) -> bool:
        """Exact equality of names, order, dtypes and contents."""
        if list(self.features) != list(other.features) or list(self.dense) != list(other.dense):
            return False
        return all(f.equal(other.features[n]) for n, f in self.features.items()) and all(
            t.dtype == other.dense[n].dtype and torch.equal(t, other.dense[n])
            for n, t in self.dense.items()
        )

    def to_keyed_jagged_tensor(self) -> KeyedJaggedTensor:
        """The features as a TorchRec ``KeyedJaggedTensor`` (dense fields are not part of a KJT)."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        keys = list(self.features)
        values = [self.features[k].values for k in keys]
        if len({v.dtype for v in values}) > 1:
            raise JaggedBatchError("a KeyedJaggedTensor needs one values dtype across features")
        return KeyedJaggedTensor(
            keys=keys,
            values=torch.cat(values) if values else torch.empty(0, dtype=torch.int64),
            lengths=torch.cat([self.features[k].lengths.to(torch.int64) for k in keys])
            if keys
            else torch.empty(0, dtype=torch.int64),
        )

    @classmethod
    def from_keyed_jagged_tensor(
        cls, kjt: Any, dense: Mapping[str, torch.Tensor] | None = None
    ) -> JaggedBatch:
        """A batch from a TorchRec ``KeyedJaggedTensor`` (plus optional dense fields)."""
        features = {
            key: JaggedTensor(jt.values(), jt.lengths()) for key, jt in kjt.to_dict().items()
        }
        return cls(features=features, dense=dict(dense or {}))
