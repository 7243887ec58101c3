"""Random keyed jagged inputs and trivially correct Python oracles for the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class Case:
    """One random keyed jagged input (``F`` keys over ``B`` samples) and a world size."""

    name: str
    num_keys: int = 3
    batch: int = 17
    world_size: int = 4
    dim: int = 0  # 0: 1-D values, else [N, dim] rows
    dtype: torch.dtype = torch.int64
    lengths_dtype: torch.dtype = torch.int64
    max_length: int = 6
    empty_fraction: float = 0.2
    zero_key: bool = False  # the last key has no values at all
    huge_sample: int = 0  # length of sample 0 in key 0, when non-zero
    seed: int = 0

    def __str__(self) -> str:
        return self.name


def cpu_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and values (``b`` cast to ``a``'s dtype), wherever each lives."""
    return a.shape == b.shape and torch.equal(a.cpu(), b.cpu().to(a.dtype))


def make_values(num_rows: int, dim: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    shape = (num_rows,) if dim == 0 else (num_rows, dim)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=gen).to(dtype)


def make_input(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, lengths ``[F, B]``, ranks ``[B]``) for ``case``, on ``DEVICE``."""
    gen = torch.Generator().manual_seed(case.seed)
    lengths = torch.randint(0, case.max_length + 1, (case.num_keys, case.batch), generator=gen)
    lengths[torch.rand(lengths.shape, generator=gen) < case.empty_fraction] = 0
    if case.zero_key and case.num_keys:
        lengths[-1] = 0
    if case.huge_sample and case.batch and case.num_keys:
        lengths[0, 0] = case.huge_sample
    values = make_values(int(lengths.sum()), case.dim, case.dtype, gen)
    ranks = torch.randint(0, case.world_size, (case.batch,), generator=gen)
    return values.to(DEVICE), lengths.to(case.lengths_dtype).to(DEVICE), ranks.to(DEVICE)


def runs_of(values: torch.Tensor, lengths: torch.Tensor) -> list[list[torch.Tensor]]:
    """``runs[f][b]``: the rows of sample ``b`` in key ``f`` of a key-major keyed jagged tensor."""
    runs, at = [], 0
    for key_lengths in lengths.reshape(lengths.shape[0], -1).tolist():
        row = []
        for n in key_lengths:
            row.append(values[at : at + n])
            at += n
        runs.append(row)
    return runs


def flatten_runs(runs: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(runs) if runs else like[:0]


def oracle_select(values, lengths, indices):
    runs = runs_of(values, lengths)
    picked = [[key[i] for i in indices.tolist()] for key in runs]
    out = flatten_runs([r for key in picked for r in key], values)
    picked_lengths = torch.tensor([[len(r) for r in key] for key in picked], dtype=torch.int64)
    return out, picked_lengths.reshape(len(runs), len(indices))


def oracle_dispatch(values, lengths, ranks, world_size):
    """(values, lengths, rank_splits, key_splits) by the definition of the send order."""
    runs = runs_of(values, lengths)
    ranks_list = ranks.tolist()
    sent, sent_lengths = [], []
    key_splits = [[0] * len(runs) for _ in range(world_size)]
    for rank in range(world_size):
        for key, key_runs in enumerate(runs):
            for sample, rank_of_sample in enumerate(ranks_list):
                if rank_of_sample == rank:
                    sent.append(key_runs[sample])
                    sent_lengths.append(len(key_runs[sample]))
                    key_splits[rank][key] += len(key_runs[sample])
    return (
        flatten_runs(sent, values),
        torch.tensor(sent_lengths, dtype=torch.int64),
        torch.tensor([sum(k) for k in key_splits], dtype=torch.int64),
        torch.tensor(key_splits, dtype=torch.int64).reshape(world_size, len(runs)),
    )


def oracle_combine(values, lengths, ranks, num_keys):
    """Reads rank-major runs back into ``runs[f][b]``; returns (values, lengths ``[F, B]``)."""
    ranks_list = ranks.tolist()
    flat = lengths.reshape(-1).tolist()
    runs = [[None] * len(ranks_list) for _ in range(num_keys)]
    at, run = 0, 0
    for rank in sorted(set(ranks_list)):
        for key in range(num_keys):
            for sample, rank_of_sample in enumerate(ranks_list):
                if rank_of_sample == rank:
                    runs[key][sample] = values[at : at + flat[run]]
                    at += flat[run]
                    run += 1
    out = flatten_runs([r for key in runs for r in key], values)
    out_lengths = torch.tensor([[len(r) for r in key] for key in runs], dtype=torch.int64)
    return out, out_lengths.reshape(num_keys, len(ranks_list))


def oracle_transpose(values, lengths, counts, num_keys, to_key_major):
    counts_list = counts.tolist()
    flat = lengths.reshape(-1).tolist()
    total = sum(counts_list)
    blocks: dict[tuple[int, int], list[torch.Tensor]] = {}
    at, run = 0, 0
    order = (
        [(r, k) for r in range(len(counts_list)) for k in range(num_keys)]
        if to_key_major
        else [(r, k) for k in range(num_keys) for r in range(len(counts_list))]
    )
    for rank, key in order:
        block = []
        for _ in range(counts_list[rank]):
            block.append(values[at : at + flat[run]])
            at += flat[run]
            run += 1
        blocks[rank, key] = block
    out_order = (
        [(r, k) for k in range(num_keys) for r in range(len(counts_list))]
        if to_key_major
        else [(r, k) for r in range(len(counts_list)) for k in range(num_keys)]
    )
    out_runs = [run_ for rk in out_order for run_ in blocks[rk]]
    out_lengths = torch.tensor([len(r) for r in out_runs], dtype=torch.int64)
    if to_key_major:
        out_lengths = out_lengths.reshape(num_keys, total)
    return flatten_runs(out_runs, values), out_lengths


def oracle_unique(ids):
    ids_list = ids.tolist()
    unique = sorted(set(ids_list))
    slot = {v: i for i, v in enumerate(unique)}
    order = sorted(range(len(ids_list)), key=lambda i: (ids_list[i], i))
    counts = [ids_list.count(v) for v in unique]
    return unique, [slot[v] for v in ids_list], counts, order


def oracle_segment_sum(values, offsets, order=None):
    rows = values.double() if order is None else values.double()[order]
    bounds = offsets.tolist()
    sums = []
    for s in range(len(bounds) - 1):
        total = torch.zeros(values.shape[1:], dtype=torch.float64)
        for r in range(bounds[s], bounds[s + 1]):
            total += rows[r].cpu()
        sums.append(total)
    return torch.stack(sums) if sums else torch.zeros(0, *values.shape[1:], dtype=torch.float64)
