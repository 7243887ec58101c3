"""What a user declares: the tables, the features that read them, and how they are trained."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Mode = Literal["sync", "prioritized"]
Pooling = Literal["none", "sum", "mean"]

MODES: tuple[str, ...] = ("sync", "prioritized")
POOLINGS: tuple[str, ...] = ("none", "sum", "mean")


@dataclass(frozen=True)
class TableConfig:
    """One embedding table, read by one or more jagged ID features.

    Args:
        name: unique table name (the key in state dicts and error messages).
        num_embeddings: number of rows; valid IDs are ``0 .. num_embeddings - 1``.
        embedding_dim: width of a row.
        feature_names: the batch features whose values are IDs into this table. A feature reads
            exactly one table.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: Sequence[str]

    def __post_init__(self) -> None:
        if not self.name or "." in self.name:
            raise ValueError(f"a table needs a non-empty name without '.', got {self.name!r}")
        if self.num_embeddings < 1:
            raise ValueError(f"table {self.name!r}: num_embeddings must be >= 1")
        if self.embedding_dim < 1:
            raise ValueError(f"table {self.name!r}: embedding_dim must be >= 1")
        if isinstance(self.feature_names, str):
            raise TypeError(
                f"table {self.name!r}: feature_names must be a sequence of names, not one string"
            )
        # A tuple keeps the frozen dataclass hashable and immune to the caller's later edits.
        object.__setattr__(self, "feature_names", tuple(self.feature_names))
        if not self.feature_names:
            raise ValueError(f"table {self.name!r}: needs at least one feature")


def check_tables(tables: Sequence[TableConfig]) -> None:
    """Raises ``ValueError`` unless table names are unique and each feature reads one table."""
    if not tables:
        raise ValueError("an embedding collection needs at least one table")
    seen_tables: set[str] = set()
    owner_of_feature: dict[str, str] = {}
    for table in tables:
        if table.name in seen_tables:
            raise ValueError(f"table name {table.name!r} is used twice")
        seen_tables.add(table.name)
        for feature in table.feature_names:
            if feature in owner_of_feature:
                raise ValueError(
                    f"feature {feature!r} reads both table {owner_of_feature[feature]!r} and "
                    f"table {table.name!r}; a feature reads one table"
                )
            owner_of_feature[feature] = table.name
