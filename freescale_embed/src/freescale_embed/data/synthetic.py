"""Synthetic sequence data: heavy-tailed histories, Zipf items and a learnable next-item signal.

User ``u``'s sequence is a pure function of ``(config, u)``: its length is drawn from the
balance simulation's log-normal length model, each item is, with probability
``transition_prob``, a hidden function of the previous item (a transition table drawn once from
the seed) and otherwise a Zipf draw. The first ``L_u`` items are the training history, the next
one is held out for evaluation.

The training stream is cut into global batches that are the same for every world size: global
step ``g`` covers samples ``[g*G, (g+1)*G)`` of a seeded per-epoch order of the users, and rank
``r`` of ``w`` takes the contiguous slice ``[r*G/w, (r+1)*G/w)`` of it. Every random choice is
a counter-based hash of the seed and the sample's coordinates, so a rank builds its slice of
any step without generating the others (``start_step`` resumes there for free). The MovieLens
loader reuses the stream layout and the hash from here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from freescale_balance import JaggedBatch, JaggedTensor
from freescale_balance.simulate import LengthDistribution

# Counter streams: one per kind of random choice, so that no two kinds reuse a hash value.
_ORDER, _LENGTHS, _POPULARITY, _TARGETS, _TRANSITION = range(5)
_FOLLOW, _ITEM, _NEGATIVE, _CANDIDATE = range(5, 9)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)

NUM_EVAL_NEGATIVES = 100


@dataclass(frozen=True)
class SyntheticConfig:
    """The synthetic dataset and its training stream.

    Attributes:
        num_users: users in the dataset (one training sample per user and epoch).
        num_items: item IDs ``0 .. num_items - 1``.
        max_history: longest training history.
        min_history: shortest training history (at least 2: one target).
        median_fraction: median history length as a share of ``max_history``.
        sigma: log-normal shape of the history lengths.
        zipf_exponent: popularity skew of the fresh (non-transition) items.
        transition_exponent: popularity skew of the transition table's targets.
        transition_prob: probability that the next item is the previous item's transition.
        num_negatives: sampled negatives per training sample (shared by its positions).
        global_batch_size: samples per global step (split evenly over the ranks).
        num_steps: global steps of the stream (``None``: one epoch, ``num_users //
            global_batch_size`` steps).
        num_eval_users: users ``0 .. num_eval_users - 1`` are evaluated (``None``: all).
        seed: seed of everything.
    """

    num_users: int = 10_000
    num_items: int = 10_000
    max_history: int = 512
    min_history: int = 3
    median_fraction: float = 1 / 8
    sigma: float = 0.75
    zipf_exponent: float = 1.1
    transition_exponent: float = 0.5
    transition_prob: float = 0.7
    num_negatives: int = 128
    global_batch_size: int = 64
    num_steps: int | None = None
    num_eval_users: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not 2 <= self.min_history <= self.max_history:
            raise ValueError(
                f"need 2 <= min_history <= max_history, got {self.min_history}, {self.max_history}"
            )
        if self.num_items <= NUM_EVAL_NEGATIVES + self.max_history:
            raise ValueError(
                f"num_items ({self.num_items}) must exceed max_history + 1 + "
                f"{NUM_EVAL_NEGATIVES} so that every user has {NUM_EVAL_NEGATIVES} unseen items"
            )
        if self.num_users < self.global_batch_size:
            raise ValueError("num_users must be at least global_batch_size (one step per epoch)")
        if not 0.0 <= self.transition_prob <= 1.0:
            raise ValueError(f"transition_prob must be in [0, 1], got {self.transition_prob}")
        if self.num_negatives < 1 or self.global_batch_size < 1 or self.seed < 0:
            raise ValueError("num_negatives and global_batch_size must be >= 1, seed >= 0")


def counter_uniform(seed: int, stream: int, *keys: npt.ArrayLike) -> np.ndarray:
    """Floats in ``[0, 1)``, one per element of the broadcast ``keys``.

    Each value is a pure function of ``(seed, stream, keys)`` (chained splitmix64), so any
    element can be drawn without drawing the others. Keys must be non-negative integers.
    """
    arrays = [np.asarray(key, dtype=np.uint64) for key in keys]
    state = np.full(np.broadcast_shapes(*(a.shape for a in arrays)), seed, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for key in (np.uint64(stream), *arrays):
            state = _mix(state + _mix(key + _GOLDEN))
    return (state >> np.uint64(11)).astype(np.float64) * 2.0**-53


def counter_integers(seed: int, stream: int, *keys: npt.ArrayLike, high: int) -> np.ndarray:
    """Integers in ``[0, high)``, uniform, one per element of the broadcast ``keys``."""
    values = (counter_uniform(seed, stream, *keys) * high).astype(np.int64)
    return np.minimum(values, high - 1)


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample_unseen(
    seed: int, stream: int, user: int, seen: np.ndarray, num_items: int, count: int
) -> np.ndarray:
    """``count`` distinct items the user never interacted with, uniformly, in draw order.

    The draws are the hash sequence of ``(seed, stream, user, j)`` for ``j = 0, 1, ...`` with
    seen items and repeats skipped, so the result depends only on those and ``seen``.
    """
    if num_items - np.unique(seen).size < count:
        raise ValueError(f"user {user} has fewer than {count} items it never interacted with")
    picked = np.empty(0, dtype=np.int64)
    drawn = 0
    while picked.size < count:
        draws = counter_integers(
            seed, stream, user, np.arange(drawn, drawn + 2 * count), high=num_items
        )
        drawn += 2 * count
        picked = np.concatenate([picked, draws[~np.isin(draws, seen)]])
        _, first = np.unique(picked, return_index=True)
        picked = picked[np.sort(first)]
    return picked[:count]


def eval_candidates(
    seed: int,
    stream: int,
    users: np.ndarray,
    held_out: np.ndarray,
    seen: Sequence[np.ndarray],
    num_items: int,
) -> np.ndarray:
    """``[B, 101]`` candidates: each user's held-out item, then 100 distinct items outside the
    user's ``seen`` items (``sample_unseen``)."""
    rows = [
        np.concatenate(
            [[target], sample_unseen(seed, stream, int(user), items, num_items, NUM_EVAL_NEGATIVES)]
        )
        for user, target, items in zip(users, held_out, seen, strict=True)
    ]
    return np.stack(rows) if rows else np.empty((0, NUM_EVAL_NEGATIVES + 1), dtype=np.int64)


def local_slice(global_batch_size: int, rank: int, world_size: int) -> slice:
    """Rank ``rank``'s contiguous part of a global batch; raises ``ValueError`` if uneven."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    if global_batch_size % world_size:
        raise ValueError(
            f"global_batch_size {global_batch_size} is not divisible by the world size "
            f"{world_size}: every rank must get the same number of samples"
        )
    size = global_batch_size // world_size
    return slice(rank * size, (rank + 1) * size)


def global_batch_stream(
    num_samples: int,
    global_batch_size: int,
    num_steps: int | None,
    seed: int,
    rank: int,
    world_size: int,
    start_step: int,
    make_batch: Callable[[int, np.ndarray, np.ndarray], JaggedBatch],
) -> Iterator[JaggedBatch]:
    """Rank ``rank``'s batches of global steps ``start_step .. num_steps - 1``.

    Global step ``g`` of epoch ``e = g // steps_per_epoch`` covers positions
    ``[j*G, (j+1)*G)``, ``j = g % steps_per_epoch``, of epoch ``e``'s seeded order of the
    samples (the last ``num_samples % G`` of an order are left out).

    Args:
        make_batch: ``(epoch, samples, sample_ids) -> batch`` for this rank's samples (dataset
            indices) and their positions in the stream (``g*G + i``).

    Raises:
        ValueError: at the call (not at the first ``next``) if the world does not split the
            global batch evenly or an epoch has no step.
    """
    part = local_slice(global_batch_size, rank, world_size)
    steps_per_epoch = num_samples // global_batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{num_samples} samples make no global batch of {global_batch_size}")
    if start_step < 0:
        raise ValueError(f"start_step must be >= 0, got {start_step}")
    total = steps_per_epoch if num_steps is None else num_steps

    def stream() -> Iterator[JaggedBatch]:
        order_epoch, order = -1, np.empty(0, dtype=np.int64)
        for step in range(start_step, total):
            epoch, within = divmod(step, steps_per_epoch)
            if epoch != order_epoch:
                order_epoch = epoch
                order = np.random.default_rng([seed, _ORDER, epoch]).permutation(num_samples)
            begin = within * global_batch_size
            samples = order[begin + part.start : begin + part.stop]
            sample_ids = step * global_batch_size + np.arange(part.start, part.stop)
            yield make_batch(epoch, samples, sample_ids)

    return stream()


def eval_users(num_users: int, rank: int, world_size: int, batch_size: int) -> Iterator[np.ndarray]:
    """Rank ``rank``'s contiguous block of users ``0 .. num_users - 1``, ``batch_size`` at a time.

    Blocks differ in size by at most one user, so ranks may yield different numbers of batches.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    mine = np.array_split(np.arange(num_users), world_size)[rank]
    for begin in range(0, mine.size, batch_size):
        yield mine[begin : begin + batch_size]


def make_training_batch(
    history: JaggedTensor, negatives: np.ndarray, users: np.ndarray, sample_ids: np.ndarray
) -> JaggedBatch:
    """The training batch schema: ``history``, ``negatives`` (``[B, K]``), ``sample_id``,
    ``user_id``."""
    batch_size, num_negatives = negatives.shape
    return JaggedBatch(
        features={
            "history": history,
            "negatives": JaggedTensor(
                torch.from_numpy(negatives.reshape(-1)),
                torch.full((batch_size,), num_negatives, dtype=torch.int64),
            ),
        },
        dense=_ids(users, sample_ids),
    )


def make_eval_batch(
    history: JaggedTensor, candidates: np.ndarray, users: np.ndarray
) -> JaggedBatch:
    """The evaluation batch schema: ``history``, ``candidates`` (``[B, 101]``, the held-out item
    first), ``sample_id`` and ``user_id`` (both the user)."""
    batch_size, width = candidates.shape
    return JaggedBatch(
        features={
            "history": history,
            "candidates": JaggedTensor(
                torch.from_numpy(candidates.reshape(-1)),
                torch.full((batch_size,), width, dtype=torch.int64),
            ),
        },
        dense=_ids(users, users),
    )


def _ids(users: np.ndarray, sample_ids: np.ndarray) -> dict[str, torch.Tensor]:
    return {
        "sample_id": torch.from_numpy(np.asarray(sample_ids, dtype=np.int64)),
        "user_id": torch.from_numpy(np.asarray(users, dtype=np.int64)),
    }


class _Zipf:
    """Items drawn by popularity rank ``k`` with weight ``(k + 1) ** -exponent``."""

    def __init__(self, num_items: int, exponent: float, rank_to_item: np.ndarray) -> None:
        weights = np.arange(1, num_items + 1, dtype=np.float64) ** -exponent
        self._cdf = np.cumsum(weights) / weights.sum()
        self._rank_to_item = rank_to_item

    def __call__(self, uniform: np.ndarray) -> np.ndarray:
        ranks = np.searchsorted(self._cdf, uniform, side="right")
        return self._rank_to_item[np.minimum(ranks, self._cdf.size - 1)]


def _permutation(config: SyntheticConfig, stream: int) -> np.ndarray:
    return np.random.default_rng([config.seed, stream]).permutation(config.num_items)


class SyntheticDataset:
    """The users' sequences of a ``SyntheticConfig``, generated on demand.

    Building one draws every user's history length and the transition table (``O(num_users +
    num_items)``); sequences are generated per call, vectorised over the users asked for.
    """

    def __init__(self, config: SyntheticConfig) -> None:
        self.config = config
        # The balance simulation's length model, drawn for all users at once: numpy fills the
        # array in order, so user u's length depends on (seed, u) and not on num_users.
        model = LengthDistribution(sigma=config.sigma, median_fraction=config.median_fraction)
        rng = np.random.default_rng([config.seed, _LENGTHS])
        lengths = model.sample(config.max_history, config.num_users, rng).numpy()
        self.lengths = np.maximum(lengths, config.min_history)
        self._fresh_item = _Zipf(
            config.num_items, config.zipf_exponent, _permutation(config, _POPULARITY)
        )
        # The targets have their own popularity order (and a milder skew), so that the signal
        # is more than "popular items come next".
        targets = _Zipf(
            config.num_items, config.transition_exponent, _permutation(config, _TARGETS)
        )
        self.transition = targets(
            counter_uniform(config.seed, _TRANSITION, np.arange(config.num_items))
        )

    def sequences(self, users: np.ndarray, extra: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The users' items in time order, concatenated, and the sequence lengths.

        Args:
            users: user indices.
            extra: items generated past each training history (1: the held-out item too).
        """
        config = self.config
        users = np.asarray(users, dtype=np.int64)
        lengths = self.lengths[users] + extra
        total = int(lengths.sum())
        index = np.arange(total)
        owner = np.repeat(users, lengths)
        position = index - np.repeat(np.cumsum(lengths) - lengths, lengths)
        fresh = (position == 0) | (
            counter_uniform(config.seed, _FOLLOW, owner, position) >= config.transition_prob
        )
        items = np.empty(total, dtype=np.int64)
        items[fresh] = self._fresh_item(
            counter_uniform(config.seed, _ITEM, owner[fresh], position[fresh])
        )
        # An item that follows its predecessor is transition^depth of the last fresh item, so
        # the chains resolve in max-depth vectorised passes instead of one per position.
        depth = index - np.maximum.accumulate(np.where(fresh, index, 0))
        for level in range(1, int(depth.max(initial=0)) + 1):
            at = np.flatnonzero(depth == level)
            items[at] = self.transition[items[at - 1]]
        return items, lengths

    def history(self, users: np.ndarray) -> JaggedTensor:
        """The users' training histories."""
        items, lengths = self.sequences(users)
        return JaggedTensor(torch.from_numpy(items), torch.from_numpy(lengths))

    def item_counts(self, chunk: int = 4096) -> torch.Tensor:
        """How often each item occurs in the training histories of all users (int64)."""
        counts = np.zeros(self.config.num_items, dtype=np.int64)
        for begin in range(0, self.config.num_users, chunk):
            items, _ = self.sequences(np.arange(begin, min(begin + chunk, self.config.num_users)))
            counts += np.bincount(items, minlength=self.config.num_items)
        return torch.from_numpy(counts)

    def training_batch(self, samples: np.ndarray, sample_ids: np.ndarray) -> JaggedBatch:
        """The training batch of ``samples`` (users) at stream positions ``sample_ids``."""
        config = self.config
        negatives = counter_integers(
            config.seed,
            _NEGATIVE,
            sample_ids[:, None],
            np.arange(config.num_negatives)[None, :],
            high=config.num_items,
        )
        return make_training_batch(self.history(samples), negatives, samples, sample_ids)

    def eval_batch(self, users: np.ndarray) -> JaggedBatch:
        """The evaluation batch of ``users``: whole training histories and 101 candidates."""
        config = self.config
        items, lengths = self.sequences(users, extra=1)
        ends = np.cumsum(lengths)
        candidates = eval_candidates(
            config.seed,
            _CANDIDATE,
            users,
            items[ends - 1],
            np.split(items, ends[:-1]),
            config.num_items,
        )
        keep = np.ones(items.size, dtype=bool)
        keep[ends - 1] = False
        history = JaggedTensor(torch.from_numpy(items[keep]), torch.from_numpy(lengths - 1))
        return make_eval_batch(history, candidates, np.asarray(users, dtype=np.int64))


def synthetic_batches(
    config: SyntheticConfig, rank: int, world_size: int, start_step: int = 0
) -> Iterator[JaggedBatch]:
    """Rank ``rank``'s training batches, global steps ``start_step .. num_steps - 1``.

    Each batch has ``global_batch_size / world_size`` samples; concatenating the ranks' batches
    of a step in rank order gives the same global batch for every world size. A sample's
    negatives depend only on ``(seed, sample_id)``.

    Raises:
        ValueError: if ``world_size`` does not divide ``global_batch_size``.
    """
    dataset = SyntheticDataset(config)
    return global_batch_stream(
        config.num_users,
        config.global_batch_size,
        config.num_steps,
        config.seed,
        rank,
        world_size,
        start_step,
        lambda _epoch, samples, sample_ids: dataset.training_batch(samples, sample_ids),
    )


def synthetic_eval_batches(
    config: SyntheticConfig, rank: int, world_size: int, batch_size: int
) -> Iterator[JaggedBatch]:
    """Rank ``rank``'s evaluation batches of at most ``batch_size`` users.

    The evaluated users (``num_eval_users``, default all) are split into contiguous blocks, one
    per rank. Each sample's ``candidates`` are its held-out item (the one its generative process
    produces after the training history), then 100 distinct items the user never interacted
    with, drawn per ``(seed, user)``.
    """
    dataset = SyntheticDataset(config)
    num_users = config.num_users if config.num_eval_users is None else config.num_eval_users
    return (
        dataset.eval_batch(users) for users in eval_users(num_users, rank, world_size, batch_size)
    )


def synthetic_item_counts(config: SyntheticConfig) -> torch.Tensor:
    """Training occurrences of each item over all users (for the popularity baseline)."""
    return SyntheticDataset(config).item_counts()
