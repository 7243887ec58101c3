"""Ranking metrics of the sampled protocol: the positive (column 0) among its candidates.

Ties are broken uniformly at random, in expectation: a positive with ``g`` candidates scoring
strictly higher and ``t`` scoring the same has each rank ``g .. g + t`` with probability
``1 / (t + 1)``, and the metrics are their exact averages. This is the strict ranking when no
score ties, and it neither rewards nor punishes a ranker (a popularity count, say) that gives
many candidates the same score.
"""

from __future__ import annotations

import torch


def hit_rate_and_ndcg(scores: torch.Tensor, k: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """HR@k and NDCG@k per sample.

    Args:
        scores: ``[B, C]``, the positive's score in column 0, the negatives' after it.
        k: cut-off rank.

    Returns:
        ``(hits, ndcg)``, float32 ``[B]`` each: the probability that the positive ranks in the
        top ``k``, and the expected ``1 / log2(rank + 2)`` of a top-``k`` rank (0-based ranks,
        0 beyond ``k``), both over the random order of ties.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    positive, negatives = scores[:, :1], scores[:, 1:]
    higher = (negatives > positive).sum(1)
    ties = (negatives == positive).sum(1)
    choices = (ties + 1).to(torch.float32)
    # gain_below[r] = sum of 1 / log2(j + 2) over ranks j < r, for r = 0 .. k.
    gain = 1.0 / torch.log2(torch.arange(k, dtype=torch.float32, device=scores.device) + 2)
    gain_below = torch.cat([gain.new_zeros(1), torch.cumsum(gain, 0)])
    first = higher.clamp(max=k)
    end = (higher + ties + 1).clamp(max=k)
    hits = (end - first).to(torch.float32) / choices
    ndcg = (gain_below[end] - gain_below[first]) / choices
    return hits, ndcg


def popularity_scores(candidates: torch.Tensor, item_counts: torch.Tensor) -> torch.Tensor:
    """The popularity baseline's scores: each candidate's training count.

    Args:
        candidates: int64 ``[B, C]`` item IDs (e.g.
            ``fixed_width(batch.features["candidates"], "candidates")``).
        item_counts: ``[num_items]`` training occurrences of each item.

    Returns:
        float32 ``[B, C]``, for ``hit_rate_and_ndcg``.
    """
    return item_counts[candidates].to(torch.float32)
