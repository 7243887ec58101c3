"""Synthetic sequence batches whose consecutive steps share a chosen share of rows.

Used by the benchmark and the tests. Every batch is a pure function of (config, rank, step), so
any rank (or a single-process reference) can rebuild every rank's batch.

Per table and step the global row set ``S_t`` has ``rows_per_step`` rows; ``S_t+1`` takes
``round(collision_rate * rows_per_step)`` of them from ``S_t`` and the rest from rows outside
``S_t``, so the step's collision rate is exact. Rank ``r`` gets the rows ``S_t[r::world]`` (the
ranks together read all of ``S_t``) plus as many again drawn Zipf-distributed from all of
``S_t``: hot rows repeat within a rank and across ranks, as in real traffic. With
``collision_rate=None`` the IDs are drawn Zipf-distributed from the whole table instead, and the
collision rate is whatever that gives (high: the hot rows are in every step).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from freescale_balance import JaggedBatch, JaggedTensor
from freescale_embed.config import TableConfig


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of the synthetic traffic.

    Attributes:
        tables: the tables (their features get IDs).
        world_size: ranks.
        batch_size: samples per rank and step.
        rows_per_step: ``|S_t|`` per table (``collision_rate`` mode).
        collision_rate: share of ``S_t+1`` taken from ``S_t``; ``None`` for plain Zipf IDs.
        ids_per_rank: IDs per rank, step and table in plain Zipf mode.
        zipf_alpha: exponent of the Zipf draws.
        seed: seed of everything.
    """

    tables: tuple[TableConfig, ...]
    world_size: int
    batch_size: int = 8
    rows_per_step: int = 64
    collision_rate: float | None = 0.05
    ids_per_rank: int = 64
    zipf_alpha: float = 1.1
    seed: int = 0


def _generator(*keys: int) -> torch.Generator:
    seed = 0
    for key in keys:
        seed = (seed * 1_000_003 + key) % (2**61 - 1)
    return torch.Generator().manual_seed(seed)


def _zipf(count: int, support: int, alpha: float, generator: torch.Generator) -> torch.Tensor:
    if count == 0 or support == 0:
        return torch.zeros(0, dtype=torch.int64)
    weights = torch.arange(1, support + 1, dtype=torch.float64).pow(-alpha)
    return torch.multinomial(weights, count, replacement=True, generator=generator)


@functools.lru_cache(maxsize=64)
def row_set(config: WorkloadConfig, table: int, step: int) -> torch.Tensor:
    """``S_step`` of ``table`` (global rows, in a random order; do not modify it)."""
    rows = config.tables[table].num_embeddings
    size = min(config.rows_per_step, rows)
    generator = _generator(config.seed, table, step, 1)
    if step == 0:
        chosen = torch.randperm(rows, generator=generator)[:size]
    else:
        previous = row_set(config, table, step - 1)
        kept = round((config.collision_rate or 0.0) * size)
        keep = previous[torch.randperm(previous.numel(), generator=generator)[:kept]]
        outside = torch.ones(rows, dtype=torch.bool)
        outside[previous] = False
        candidates = torch.nonzero(outside).flatten()
        fresh = candidates[torch.randperm(candidates.numel(), generator=generator)]
        chosen = torch.cat([keep, fresh[: size - kept]])
    return chosen


def _table_ids(config: WorkloadConfig, table: int, rank: int, step: int) -> torch.Tensor:
    generator = _generator(config.seed, table, step, rank, 2)
    if config.collision_rate is None:
        rows = config.tables[table].num_embeddings
        return _zipf(config.ids_per_rank, rows, config.zipf_alpha, generator)
    rows = row_set(config, table, step)
    mine = rows[rank :: config.world_size]
    drawn = rows[_zipf(mine.numel(), rows.numel(), config.zipf_alpha, generator)]
    ids = torch.cat([mine, drawn])
    return ids[torch.randperm(ids.numel(), generator=generator)]


def _split_lengths(total: int, parts: int, generator: torch.Generator) -> torch.Tensor:
    """Random non-negative lengths summing to ``total`` (some samples may be empty)."""
    if parts == 0:
        return torch.zeros(0, dtype=torch.int64)
    cuts = torch.sort(torch.randint(0, total + 1, (parts - 1,), generator=generator)).values
    bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([total])])
    return bounds[1:] - bounds[:-1]


def make_batch(config: WorkloadConfig, rank: int, step: int) -> JaggedBatch:
    """Rank ``rank``'s batch of step ``step``: each table's IDs split over its features."""
    features = {}
    for index, table in enumerate(config.tables):
        ids = _table_ids(config, index, rank, step)
        generator = _generator(config.seed, index, step, rank, 3)
        names = table.feature_names
        sizes = _split_lengths(ids.numel(), len(names), generator).tolist()
        for name, part in zip(names, ids.split(sizes), strict=True):
            lengths = _split_lengths(part.numel(), config.batch_size, generator)
            features[name] = JaggedTensor(part, lengths)
    return JaggedBatch(features=features)
