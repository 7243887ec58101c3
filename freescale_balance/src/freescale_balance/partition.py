"""Partitioners: which rank computes each sample of a global batch.

Pure functions, no communication. The global batch is every rank's local batch concatenated in
rank order; a partition gives each sample a destination rank. Within a rank, samples keep their
global order, so a partition is fully described by its ``ranks`` tensor.

Policies:
    ``none``: every sample stays where it was loaded (the unbalanced baseline).
    ``fbs``: sort by cost, deal out in zig-zag (snake) order: equal counts per rank.
    ``vbs``: weights ``length ** alpha``, contiguous cuts of equal weight in the original order:
        variable counts per rank.
    ``kk``: Karmarkar–Karp largest differencing with equal counts (the bar FBS is held to).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

Policy = Literal["none", "fbs", "vbs", "kk"]
POLICIES: tuple[Policy, ...] = ("none", "fbs", "vbs", "kk")


@dataclass(frozen=True)
class Partition:
    """Where each sample of the global batch goes.

    Attributes:
        ranks: int64 ``[global_batch]``, destination rank of each sample.
        world_size: number of ranks.
    """

    ranks: torch.Tensor
    world_size: int

    def counts(self) -> torch.Tensor:
        """Samples per destination rank, int64 ``[world_size]``."""
        return torch.bincount(self.ranks, minlength=self.world_size)

    def loads(self, costs: torch.Tensor) -> torch.Tensor:
        """Total cost per destination rank, float64 ``[world_size]``."""
        return torch.zeros(self.world_size, dtype=torch.float64).index_add_(
            0, self.ranks, costs.to(torch.float64)
        )

    def samples_of(self, rank: int) -> torch.Tensor:
        """Global indices of the samples ``rank`` computes, in their original order."""
        return torch.nonzero(self.ranks == rank).flatten()


def straggler_fraction(loads: torch.Tensor) -> float:
    """``(max - mean) / max`` of per-rank loads: the share of the slowest rank's time idled."""
    loads = loads.to(torch.float64)
    peak = float(loads.max())
    return 0.0 if peak <= 0 else (peak - float(loads.mean())) / peak


def _check(costs: torch.Tensor, world_size: int) -> np.ndarray:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if costs.dim() != 1:
        raise ValueError(f"costs must be 1-D over the global batch, got shape {tuple(costs.shape)}")
    array = costs.detach().to("cpu", torch.float64).numpy()
    if array.size and not (np.isfinite(array).all() and array.min() >= 0):
        raise ValueError("costs must be finite and non-negative")
    return array


def source_ranks(local_counts: torch.Tensor | list[int]) -> torch.Tensor:
    """The rank each sample of the global batch was loaded on, from local batch sizes."""
    counts = torch.as_tensor(local_counts, dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(counts.numel()), counts)


def argsort_descending(values: np.ndarray) -> np.ndarray:
    """Indices that sort ``values`` descending, ties in ascending index order.

    Every rank must compute the identical plan, so ties may not depend on the sort algorithm
    (NumPy picks SIMD sorts by CPU). A stable sort guarantees that but costs ~3 ms at 32K
    samples; two unstable sorts, the second over unique keys (value rank, index), cost half.
    """
    n = values.size
    order = np.argsort(-values)
    ranked = values[order]
    value_rank = np.empty(n, dtype=np.int64)
    value_rank[order] = np.concatenate(([0], np.cumsum(ranked[1:] != ranked[:-1])))
    return np.argsort(value_rank * n + np.arange(n))


def partition_none(
    costs: torch.Tensor, world_size: int, local_counts: torch.Tensor | list[int] | None = None
) -> Partition:
    """Keeps every sample on its source rank (equal local batches unless ``local_counts``)."""
    n = _check(costs, world_size).size
    if local_counts is None:
        if n % world_size:
            raise ValueError(f"{n} samples do not split evenly over {world_size} ranks")
        local_counts = [n // world_size] * world_size
    ranks = source_ranks(local_counts)
    if ranks.numel() != n or len(local_counts) != world_size:
        raise ValueError("local_counts must have world_size entries summing to len(costs)")
    return Partition(ranks, world_size)


def partition_fbs(costs: torch.Tensor, world_size: int) -> Partition:
    """FBS: deal samples out by decreasing cost in zig-zag order; counts differ by at most one."""
    array = _check(costs, world_size)
    order = argsort_descending(array)
    position = np.arange(array.size)
    offset = position % world_size
    reverse = (position // world_size) % 2 == 1
    ranks = np.empty(array.size, dtype=np.int64)
    ranks[order] = np.where(reverse, world_size - 1 - offset, offset)
    return Partition(torch.from_numpy(ranks), world_size)


def partition_vbs(costs: torch.Tensor, world_size: int) -> Partition:
    """VBS: contiguous runs of the original order with (nearly) equal total cost per rank.

    ``costs`` are the weights, typically ``lengths ** alpha`` (see ``vbs_weights``). A sample goes
    to the rank whose share of the total contains the midpoint of its weight, so cuts never split
    a sample and runs stay contiguous; counts vary with the weights, and a rank may get none.
    """
    array = _check(costs, world_size)
    total = array.sum()
    if array.size == 0 or total <= 0:
        return partition_fbs(costs, world_size)
    midpoints = np.cumsum(array) - array / 2
    ranks = np.minimum((midpoints * world_size / total).astype(np.int64), world_size - 1)
    return Partition(torch.from_numpy(ranks), world_size)


def vbs_weights(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """The VBS weight ``length ** alpha`` of each sample."""
    return lengths.to(torch.float64).clamp_min(0) ** alpha


def partition_kk(costs: torch.Tensor, world_size: int) -> Partition:
    """Karmarkar–Karp largest differencing with equal counts per rank.

    Samples sorted by cost are cut into groups of ``world_size`` consecutive samples; each group
    is a partial solution that gives one sample to each of ``world_size`` slots. The two partial
    solutions with the largest spread (max - min slot sum) are repeatedly merged, heaviest slot of
    one with lightest of the other, until one remains. Slots map to ranks at the end; each merge
    only records how slots were paired, so the whole run is O(n log n + (n / W) * W log W).
    """
    array = _check(costs, world_size)
    n = array.size
    if n == 0:
        return Partition(torch.empty(0, dtype=torch.int64), world_size)
    groups = -(-n // world_size)
    padded = np.zeros(groups * world_size)
    order = argsort_descending(array)
    padded[:n] = array[order]
    sums = padded.reshape(groups, world_size)

    # Each merge appends a node: node id -> (children, for each child the node-slot of each of
    # its slots). Leaves are groups 0..groups-1 with slot j holding sorted sample g*W + j.
    parents: list[tuple[int, np.ndarray, int, np.ndarray]] = []
    heap = [(-(row[0] - row[-1]), g, row) for g, row in enumerate(sums)]
    heapq.heapify(heap)
    next_id = groups
    while len(heap) > 1:
        _, a, sums_a = heapq.heappop(heap)
        _, b, sums_b = heapq.heappop(heap)
        # sums are kept sorted descending: pair a's heaviest with b's lightest.
        merged = sums_a + sums_b[::-1]
        resort = np.argsort(-merged, kind="stable")
        slot_a = np.empty(world_size, dtype=np.int64)
        slot_a[resort] = np.arange(world_size)
        slot_b = slot_a[::-1].copy()
        parents.append((a, slot_a, b, slot_b))
        merged = merged[resort]
        heapq.heappush(heap, (-(merged[0] - merged[-1]), next_id, merged))
        next_id += 1

    # Walk merges from the root down: a child's slot s lands where its parent's slot lands.
    final_slot: dict[int, np.ndarray] = {heap[0][1]: np.arange(world_size)}
    for node in range(next_id - 1, groups - 1, -1):
        a, slot_a, b, slot_b = parents[node - groups]
        root_slots = final_slot.pop(node)
        final_slot[a] = root_slots[slot_a]
        final_slot[b] = root_slots[slot_b]
    slot_of_sorted = np.concatenate([final_slot[g] for g in range(groups)])[:n]
    ranks = np.empty(n, dtype=np.int64)
    ranks[order] = slot_of_sorted
    return Partition(torch.from_numpy(ranks), world_size)


def partition(
    costs: torch.Tensor,
    world_size: int,
    policy: Policy = "fbs",
    *,
    local_counts: torch.Tensor | list[int] | None = None,
) -> Partition:
    """Assigns every sample of a global batch to a rank.

    Args:
        costs: 1-D, one non-negative cost per sample of the global batch (for ``vbs`` the weights
            ``length ** alpha``; see ``vbs_weights``).
        world_size: number of ranks.
        policy: ``"none"``, ``"fbs"``, ``"vbs"`` or ``"kk"``.
        local_counts: local batch sizes per source rank; only ``"none"`` needs them, and only
            when local batches are uneven.

    Returns:
        A ``Partition`` whose ``.ranks`` is the int64 destination rank of every sample.

    Example::

        >>> partition(torch.tensor([9.0, 1.0, 5.0, 5.0]), 2, "fbs").ranks
        tensor([0, 0, 1, 1])
    """
    if policy == "none":
        return partition_none(costs, world_size, local_counts)
    if policy == "fbs":
        return partition_fbs(costs, world_size)
    if policy == "vbs":
        return partition_vbs(costs, world_size)
    if policy == "kk":
        return partition_kk(costs, world_size)
    raise ValueError(f"unknown partition policy {policy!r}; choose one of {POLICIES}")


def partition_or_keep(
    costs: torch.Tensor,
    world_size: int,
    policy: Policy,
    local_counts: torch.Tensor | list[int],
    min_gain: float = 0.0,
) -> Partition:
    """``partition`` by ``policy``, unless it lowers the slowest rank's cost by less than
    ``min_gain`` of it: then every sample stays on the rank it was loaded on.

    This is the assignment ``Balancer`` computes on every rank (``BalancerConfig.min_gain``).

    Args:
        costs: the policy's per-sample costs over the global batch (``vbs``: its weights).
        world_size: number of ranks.
        policy: ``"none"``, ``"fbs"``, ``"vbs"`` or ``"kk"``.
        local_counts: local batch sizes per source rank.
        min_gain: fraction of the slowest rank's cost below which balancing is not worth it.
    """
    assignment = partition(costs, world_size, policy, local_counts=local_counts)
    if min_gain <= 0 or policy == "none" or not costs.numel():
        return assignment
    loaded = partition_none(costs, world_size, local_counts)
    peak = float(loaded.loads(costs).max())
    gain = peak - float(assignment.loads(costs).max())
    return loaded if gain < min_gain * peak else assignment
