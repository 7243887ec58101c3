"""This rank's shard of one table: its rows and their optimizer state, as module buffers.

Buffers (not parameters) because the rows are updated by the fused optimizer inside backward,
never by the caller's dense optimizer. A state dict holds this rank's rows by default; loading
also accepts the full table (as ``ShardedEmbeddingCollection.state_dict(full=True)`` writes it)
and keeps this rank's block of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from freescale_embed.config import TableConfig
from freescale_embed.optim import Optimizer, initial_state
from freescale_embed.sharding import RowShard


class TableShard(nn.Module):
    """Rows ``[shard.start, shard.end)`` of a table and their optimizer state.

    Args:
        shard: which rows this rank owns.
        optimizer: decides which state tensors exist.
        weight: the initial rows, ``[shard.rows, embedding_dim]``, on the shard's device (the
            optimizer state is made beside it).
    """

    def __init__(self, shard: RowShard, optimizer: Optimizer, weight: torch.Tensor) -> None:
        super().__init__()
        self.shard = shard
        self.register_buffer("weight", weight)
        self.state_names = tuple(optimizer.state_shapes(self.embedding_dim))
        for name, tensor in initial_state(
            optimizer, shard.rows, self.embedding_dim, weight.dtype, weight.device
        ).items():
            self.register_buffer(name, tensor)

    @property
    def config(self) -> TableConfig:
        """The table this shard is a block of."""
        return self.shard.table

    @property
    def embedding_dim(self) -> int:
        return self.shard.table.embedding_dim

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.state_names}

    @property
    def state_width(self) -> int:
        """Elements of optimizer state per row."""
        return sum(self._width(name) for name in self.state_names)

    def _width(self, name: str) -> int:
        return math.prod(getattr(self, name).shape[1:])

    def state_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The optimizer state of local ``rows``, each row's state tensors side by side."""
        parts = [
            getattr(self, name).index_select(0, rows).reshape(rows.numel(), self._width(name))
            for name in self.state_names
        ]
        return torch.cat(parts, dim=1) if parts else self.weight.new_empty(rows.numel(), 0)

    def split_state(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Inverse of ``state_rows``: per state name, ``[rows, *shape]`` (own memory)."""
        state, start = {}, 0
        for name in self.state_names:
            shape, width = getattr(self, name).shape[1:], self._width(name)
            state[name] = flat[:, start : start + width].reshape(-1, *shape).clone()
            start += width
        return state

    def apply(
        self, optimizer: Optimizer, rows: torch.Tensor, grads: torch.Tensor, step: int
    ) -> None:
        """One optimizer step on local ``rows`` with their aggregated ``grads``."""
        if rows.numel():
            optimizer.update(self.weight, self.optimizer_state(), rows, grads, step)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # A full table (num_embeddings rows) is cut down to this rank's block before the
        # ordinary shape-checked copy; a shard of another layout fails that check.
        full_rows, shard = self.config.num_embeddings, self.shard
        for name in ("weight", *self.state_names):
            key = prefix + name
            value = state_dict.get(key)
            if (
                isinstance(value, torch.Tensor)
                and value.dim() >= 1
                and value.shape[0] == full_rows
                and full_rows != shard.rows
            ):
                state_dict[key] = value[shard.start : shard.end]
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


class TableShards(nn.Module):
    """The shards of all tables, as submodules named by table (state-dict keys ``<name>.*``),
    iterated in table order.

    Table names are the user's: a name such as ``items`` or ``type`` would collide with an
    attribute of ``nn.ModuleDict`` or ``nn.Module``, so shards are registered straight in
    ``_modules`` (what ``add_module`` does after its attribute check) and reached by ``[name]``.
    """

    def __init__(self, shards: list[TableShard]) -> None:
        super().__init__()
        for shard in shards:
            self._modules[shard.config.name] = shard

    def __getitem__(self, name: str) -> TableShard:
        return self._modules[name]  # type: ignore[return-value]

    def __iter__(self) -> Iterator[TableShard]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._modules)

    def named_shards(self) -> list[tuple[str, TableShard]]:
        return [(name, self[name]) for name in self._modules]
