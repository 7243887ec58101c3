"""Row-wise sharding: which rank owns which contiguous block of a table's rows.

Rank ``r`` of ``world`` owns rows ``[r * block, min((r + 1) * block, num_embeddings))`` with
``block = ceil(num_embeddings / world)`` (TorchRec's row-wise layout); the last ranks may own
fewer rows, or none when a table has fewer rows than there are ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from freescale_embed.config import TableConfig

# Initial values are drawn per chunk of rows from a generator seeded by (seed, table, chunk), so
# a table starts from the same values whatever the world size and whichever rank holds a row.
_INIT_CHUNK_ROWS = 4096


@dataclass(frozen=True)
class RowShard:
    """This rank's block of one table.

    Attributes:
        table: the table's configuration.
        world_size: ranks the table is sharded over.
        rank: this rank.
    """

    table: TableConfig
    world_size: int
    rank: int

    @property
    def block(self) -> int:
        return math.ceil(self.table.num_embeddings / self.world_size)

    def range_of(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` rows owned by ``rank``."""
        rows = self.table.num_embeddings
        start = min(rank * self.block, rows)
        return start, min(start + self.block, rows)

    @property
    def start(self) -> int:
        return self.range_of(self.rank)[0]

    @property
    def end(self) -> int:
        return self.range_of(self.rank)[1]

    @property
    def rows(self) -> int:
        return self.end - self.start

    def owners(self, ids: torch.Tensor) -> torch.Tensor:
        """Owning rank of each (valid) global ID."""
        return torch.div(ids, self.block, rounding_mode="floor")

    def initial_weight(self, seed: int, table_index: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's rows of the table's initial values: uniform in ``±sqrt(1 / rows)``."""
        bound = math.sqrt(1.0 / self.table.num_embeddings)
        dim = self.table.embedding_dim
        out = torch.empty(self.rows, dim, dtype=dtype)
        first_chunk = self.start // _INIT_CHUNK_ROWS
        last_chunk = (self.end - 1) // _INIT_CHUNK_ROWS if self.rows else first_chunk - 1
        for chunk in range(first_chunk, last_chunk + 1):
            chunk_start = chunk * _INIT_CHUNK_ROWS
            chunk_rows = min(_INIT_CHUNK_ROWS, self.table.num_embeddings - chunk_start)
            generator = torch.Generator().manual_seed(
                (seed * 1_000_003 + table_index) * 1_000_003 + chunk
            )
            values = torch.empty(chunk_rows, dim, dtype=torch.float32)
            values.uniform_(-bound, bound, generator=generator)
            lo = max(self.start, chunk_start)
            hi = min(self.end, chunk_start + chunk_rows)
            out[lo - self.start : hi - self.start] = values[lo - chunk_start : hi - chunk_start]
        return out
