"""MovieLens-100K in the training stream's layout, read from the installed RecBole package.

The data's terms forbid redistribution, so it is never copied here: ``ml-100k.inter`` is read
from RecBole 1.2.1's bundled examples (``pip install --no-deps recbole==1.2.1``). Each user's
interactions are sorted by time (ties by item), items are remapped to dense IDs in token order,
and the split is leave-one-out: the last item is held out for evaluation, the rest is the
training history (the most recent ``max_history`` of it is used).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from freescale_balance import JaggedBatch, JaggedTensor
from freescale_embed.data.synthetic import (
    counter_integers,
    eval_candidates,
    eval_users,
    global_batch_stream,
    make_eval_batch,
    make_training_batch,
)

_NEGATIVE, _CANDIDATE = 100, 101  # counter streams, apart from the synthetic data's

_INSTALL = "pip install --no-deps recbole==1.2.1"


@dataclass(frozen=True)
class MovieLensConfig:
    """The MovieLens-100K training stream.

    Attributes:
        max_history: the most recent training items a history keeps.
        num_negatives: sampled negatives per training sample (shared by its positions).
        global_batch_size: samples per global step (split evenly over the ranks).
        num_steps: global steps (``None``: one epoch, ``num_users // global_batch_size``).
        seed: seed of the epoch orders and the negatives.
        path: an ``.inter`` file to read instead of RecBole's copy.
    """

    max_history: int = 200
    num_negatives: int = 128
    global_batch_size: int = 64
    num_steps: int | None = None
    seed: int = 0
    path: str | None = None

    def __post_init__(self) -> None:
        if self.max_history < 2 or self.num_negatives < 1 or self.seed < 0:
            raise ValueError("need max_history >= 2, num_negatives >= 1 and seed >= 0")


@dataclass(frozen=True)
class MovieLens:
    """Leave-one-out MovieLens interactions with dense IDs.

    Attributes:
        items: every user's items in time order, concatenated (users in token order).
        lengths: interactions per user (at least 3: a training target and a held-out item).
        user_tokens: the file's user token of each user index.
        item_tokens: the file's item token of each item ID.
    """

    items: np.ndarray
    lengths: np.ndarray
    user_tokens: tuple[str, ...]
    item_tokens: tuple[str, ...]

    @property
    def num_users(self) -> int:
        return int(self.lengths.size)

    @property
    def num_items(self) -> int:
        return len(self.item_tokens)

    @property
    def held_out(self) -> np.ndarray:
        """Each user's last item, the evaluation target."""
        return self.items[np.cumsum(self.lengths) - 1]

    def history(self, users: np.ndarray, max_history: int) -> JaggedTensor:
        """The users' training histories: all but the last item, the most recent
        ``max_history`` of them."""
        ends = np.cumsum(self.lengths)[users] - 1
        lengths = np.minimum(self.lengths[users] - 1, max_history)
        index = np.repeat(ends - np.cumsum(lengths), lengths) + np.arange(int(lengths.sum()))
        return JaggedTensor(torch.from_numpy(self.items[index]), torch.from_numpy(lengths))

    def item_counts(self) -> torch.Tensor:
        """Training occurrences of each item (every user's items but the held-out one)."""
        training = np.ones(self.items.size, dtype=bool)
        training[np.cumsum(self.lengths) - 1] = False
        return torch.from_numpy(np.bincount(self.items[training], minlength=self.num_items))


def movielens_path() -> Path:
    """Where RecBole 1.2.1 keeps ``ml-100k.inter``.

    Raises:
        ModuleNotFoundError: if RecBole is not installed.
    """
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"MovieLens-100K is read from RecBole's bundled copy: {_INSTALL}", name="recbole"
        )
    package = Path(next(iter(spec.submodule_search_locations)))
    return package / "dataset_example" / "ml-100k" / "ml-100k.inter"


@functools.cache
def load_movielens(path: str | None = None) -> MovieLens:
    """Reads an atomic ``.inter`` file (default: RecBole's ML-100K) into leave-one-out form.

    Users with fewer than 3 interactions (no training target) are left out.
    """
    file = Path(path) if path is not None else movielens_path()
    with file.open(encoding="utf-8") as lines:
        header = [name.split(":")[0] for name in lines.readline().rstrip("\n").split("\t")]
        rows = [line.rstrip("\n").split("\t") for line in lines if line.strip()]
    column = {name: i for i, name in enumerate(header)}
    users = [row[column["user_id"]] for row in rows]
    items = [row[column["item_id"]] for row in rows]
    timestamps = np.array([float(row[column["timestamp"]]) for row in rows])
    user_tokens, user_index = _dense(users)
    item_tokens, item_ids = _dense(items)
    order = np.lexsort((item_ids, timestamps, user_index))
    lengths = np.bincount(user_index, minlength=len(user_tokens))
    keep = np.repeat(lengths >= 3, lengths)
    return MovieLens(
        items=item_ids[order][keep],
        lengths=lengths[lengths >= 3],
        user_tokens=tuple(t for t, n in zip(user_tokens, lengths, strict=True) if n >= 3),
        item_tokens=item_tokens,
    )


def _dense(tokens: list[str]) -> tuple[tuple[str, ...], np.ndarray]:
    """Tokens in order (numerically when all are integers) and each token's dense index."""
    unique = (
        sorted(set(tokens), key=int) if all(t.isdecimal() for t in tokens) else sorted(set(tokens))
    )
    index = {token: i for i, token in enumerate(unique)}
    return tuple(unique), np.array([index[t] for t in tokens], dtype=np.int64)


def movielens_batches(
    config: MovieLensConfig, rank: int, world_size: int, start_step: int = 0
) -> Iterator[JaggedBatch]:
    """Rank ``rank``'s training batches, global steps ``start_step .. num_steps - 1``, in the
    synthetic stream's layout (the same global batches for every world size). A sample's
    negatives depend on ``(seed, epoch, user)``.

    Raises:
        ValueError: if ``world_size`` does not divide ``global_batch_size``.
        ModuleNotFoundError: if RecBole is not installed (and no ``path`` is given).
    """
    data = load_movielens(config.path)

    def make_batch(epoch: int, users: np.ndarray, sample_ids: np.ndarray) -> JaggedBatch:
        negatives = counter_integers(
            config.seed,
            _NEGATIVE,
            epoch,
            users[:, None],
            np.arange(config.num_negatives)[None, :],
            high=data.num_items,
        )
        history = data.history(users, config.max_history)
        return make_training_batch(history, negatives, users, sample_ids)

    return global_batch_stream(
        data.num_users,
        config.global_batch_size,
        config.num_steps,
        config.seed,
        rank,
        world_size,
        start_step,
        make_batch,
    )


def movielens_eval_batches(
    config: MovieLensConfig, rank: int, world_size: int, batch_size: int
) -> Iterator[JaggedBatch]:
    """Rank ``rank``'s evaluation batches over its contiguous block of all users.

    Each sample's ``candidates`` are the held-out item, then 100 distinct items the user never
    rated, drawn per ``(seed, user)`` (SASRec's sampled protocol).
    """
    data = load_movielens(config.path)
    ends = np.cumsum(data.lengths)

    def make_batch(users: np.ndarray) -> JaggedBatch:
        candidates = eval_candidates(
            config.seed,
            _CANDIDATE,
            users,
            data.held_out[users],
            [data.items[ends[user] - data.lengths[user] : ends[user]] for user in users],
            data.num_items,
        )
        return make_eval_batch(data.history(users, config.max_history), candidates, users)

    return (make_batch(users) for users in eval_users(data.num_users, rank, world_size, batch_size))
