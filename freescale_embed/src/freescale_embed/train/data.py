"""The datasets ``freescale train`` trains on, behind one small interface."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from freescale_balance import JaggedBatch
from freescale_embed.data import (
    MovieLensConfig,
    SyntheticConfig,
    load_movielens,
    movielens_batches,
    movielens_eval_batches,
    synthetic_batches,
    synthetic_eval_batches,
    synthetic_item_counts,
)
from freescale_embed.train.config import TrainConfig


class Data(Protocol):
    """Global batches by index (the same for every world size), evaluation and popularity."""

    num_items: int
    max_history: int

    def batches(self, rank: int, world_size: int, start_step: int) -> Iterator[JaggedBatch]: ...

    def eval_batches(
        self, rank: int, world_size: int, batch_size: int
    ) -> Iterator[JaggedBatch]: ...

    def item_counts(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class Synthetic:
    config: SyntheticConfig

    @property
    def num_items(self) -> int:
        return self.config.num_items

    @property
    def max_history(self) -> int:
        return self.config.max_history

    def batches(self, rank: int, world_size: int, start_step: int) -> Iterator[JaggedBatch]:
        return synthetic_batches(self.config, rank, world_size, start_step)

    def eval_batches(self, rank: int, world_size: int, batch_size: int) -> Iterator[JaggedBatch]:
        return synthetic_eval_batches(self.config, rank, world_size, batch_size)

    def item_counts(self) -> torch.Tensor:
        return synthetic_item_counts(self.config)


@dataclass(frozen=True)
class MovieLens100K:
    config: MovieLensConfig

    @property
    def num_items(self) -> int:
        return load_movielens(self.config.path).num_items

    @property
    def max_history(self) -> int:
        return self.config.max_history

    def batches(self, rank: int, world_size: int, start_step: int) -> Iterator[JaggedBatch]:
        return movielens_batches(self.config, rank, world_size, start_step)

    def eval_batches(self, rank: int, world_size: int, batch_size: int) -> Iterator[JaggedBatch]:
        return movielens_eval_batches(self.config, rank, world_size, batch_size)

    def item_counts(self) -> torch.Tensor:
        return load_movielens(self.config.path).item_counts()


def open_data(config: TrainConfig) -> Data:
    """The dataset of ``config``.

    Raises:
        ModuleNotFoundError: ML-100K without RecBole installed (the message says how).
    """
    if config.dataset == "ml-100k":
        data = MovieLens100K(
            MovieLensConfig(
                max_history=config.max_history,
                num_negatives=config.num_negatives,
                global_batch_size=config.global_batch_size,
                num_steps=config.steps,
                seed=config.seed,
            )
        )
        load_movielens()  # raises here, before any rank starts, if RecBole is missing
        return data
    return Synthetic(
        SyntheticConfig(
            num_users=config.num_users,
            num_items=config.num_items,
            max_history=config.max_history,
            num_negatives=config.num_negatives,
            global_batch_size=config.global_batch_size,
            num_steps=config.steps,
            num_eval_users=config.eval_users,
            seed=config.seed,
        )
    )
