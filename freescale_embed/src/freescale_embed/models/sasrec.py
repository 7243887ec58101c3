"""SASRec (Kang & McAuley, 2018) over jagged histories, trained with a sampled softmax.

The item table lives in a ``ShardedEmbeddingCollection`` (row-wise sharded, trained by its own
optimizer inside backward); the dense part (position embeddings, pre-LayerNorm transformer
blocks, final LayerNorm) is an ordinary module for the dense optimizer and DDP. Attention stays
within each sample's own history, and no part of the loss mixes samples, so a sample's loss is
the same (to float rounding) whichever rank computes it and whatever else is in its batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from freescale_balance import CostModel, JaggedBatch, JaggedTensor
from freescale_embed.collection import ShardedEmbeddingCollection
from freescale_embed.config import TableConfig
from freescale_embed.models.attention import (
    jagged_causal_attention,
    jagged_causal_attention_torch,
    jagged_causal_attention_varlen,
)

Attention = Literal["auto", "torch", "varlen"]

_ATTENTION: dict[str, Callable[..., torch.Tensor]] = {
    "auto": jagged_causal_attention,
    "torch": jagged_causal_attention_torch,
    "varlen": jagged_causal_attention_varlen,
}


@dataclass(frozen=True)
class SASRecConfig:
    """Shape of the model.

    Attributes:
        num_items: rows of the item table.
        embedding_dim: width of item embeddings and of the transformer.
        num_layers: transformer blocks.
        num_heads: attention heads (must divide ``embedding_dim``).
        max_length: longest history the position embeddings cover.
        ffn_multiplier: hidden width of the feed-forward MLP, in units of ``embedding_dim``.
        table_name: the item table's name in the embedding collection.
        attention: ``"auto"`` (varlen flash attention on CUDA when available, else PyTorch),
            ``"torch"`` or ``"varlen"``.
    """

    num_items: int
    embedding_dim: int = 64
    num_layers: int = 2
    num_heads: int = 2
    max_length: int = 512
    ffn_multiplier: int = 4
    table_name: str = "items"
    attention: Attention = "auto"

    def __post_init__(self) -> None:
        if min(self.num_items, self.embedding_dim, self.num_heads, self.max_length) < 1:
            raise ValueError("num_items, embedding_dim, num_heads and max_length must be >= 1")
        if self.num_layers < 0 or self.ffn_multiplier < 1:
            raise ValueError("num_layers must be >= 0 and ffn_multiplier >= 1")
        if self.embedding_dim % self.num_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must divide embedding_dim ({self.embedding_dim})"
            )
        if self.attention not in _ATTENTION:
            raise ValueError(f"attention must be one of {sorted(_ATTENTION)}")


def item_tables(config: SASRecConfig) -> list[TableConfig]:
    """The embedding collection's tables: one item table read by ``history`` and
    ``negatives``."""
    return [
        TableConfig(
            config.table_name, config.num_items, config.embedding_dim, ["history", "negatives"]
        )
    ]


def cost_model(config: SASRecConfig, num_negatives: int) -> CostModel:
    """A sample's expected training cost from its history length ``L`` (for balancing).

    Per layer, attention costs ~ 4 L^2 d and the projections and MLP ~ 24 L d^2; once per
    sample, the sampled softmax ~ 2 L K d (``K`` negatives). In units of 4 d per layer (only the
    ratios matter).
    """
    layers = max(config.num_layers, 1)
    linear = 6.0 * config.embedding_dim + num_negatives / (2.0 * layers)
    return CostModel(quadratic=1.0, linear=linear, constant=0.0)


def target_counts(batch: JaggedBatch) -> torch.Tensor:
    """Predicted positions per sample (int64 ``[B]``): positions ``0 .. L-2`` predict items
    ``1 .. L-1`` of a history of length ``L``."""
    return batch.features["history"].lengths.to(torch.int64) - 1


def fixed_width(
    feature: JaggedTensor, name: str, host_lengths: Sequence[int] | None = None
) -> torch.Tensor:
    """A feature with the same number of values per sample as ``[B, width]``.

    Args:
        host_lengths: the feature's lengths on the host, if the caller has read them (else
            they are read here).

    Raises:
        ValueError: if the samples' lengths differ.
    """
    lengths = feature.lengths
    if lengths.numel() == 0:
        return feature.values.reshape(0, 0, *feature.values.shape[1:])
    if host_lengths is None:
        host_lengths = lengths.tolist()
    width = host_lengths[0]
    if any(length != width for length in host_lengths):
        raise ValueError(f"feature {name!r} must have the same length in every sample")
    return feature.values.reshape(lengths.numel(), width, *feature.values.shape[1:])


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a feed-forward MLP."""

    def __init__(self, config: SASRecConfig) -> None:
        super().__init__()
        dim = config.embedding_dim
        self.num_heads = config.num_heads
        self.attention = _ATTENTION[config.attention]
        self.attention_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ffn_norm = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(
            nn.Linear(dim, config.ffn_multiplier * dim),
            nn.GELU(),
            nn.Linear(config.ffn_multiplier * dim, dim),
        )

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_length: int) -> torch.Tensor:
        tokens, dim = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(tokens, 3, self.num_heads, -1).unbind(1)
        x = x + self.proj(self.attention(q, k, v, offsets, max_length).reshape(tokens, dim))
        return x + self.ffn(self.ffn_norm(x))


class SASRec(nn.Module):
    """Self-attentive sequential recommender over a sharded item table.

    The collection is a submodule (``TrainPipeline`` finds it through ``named_modules()``), so
    ``state_dict()`` holds this rank's shard of the table; its buffers are sharded, which DDP
    must ignore (``TrainPipeline`` sets that up). ``parameters()`` are the dense part only.

    Args:
        config: the model's shape.
        embeddings: a collection with the table ``config.table_name`` (see ``item_tables``)
            read by the features ``history`` and ``negatives``, of width ``embedding_dim``.
    """

    def __init__(self, config: SASRecConfig, embeddings: ShardedEmbeddingCollection) -> None:
        super().__init__()
        _check_table(config, embeddings)
        self.config = config
        self.embeddings = embeddings
        self.positions = nn.Embedding(config.max_length, config.embedding_dim)
        nn.init.normal_(self.positions.weight, std=0.02)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.embedding_dim)

    def encode(
        self, items: torch.Tensor, lengths: torch.Tensor, longest: int | None = None
    ) -> torch.Tensor:
        """Hidden states ``[T, dim]`` of jagged item embeddings ``[T, dim]``: position ``i`` of
        a sample sees its items ``0 .. i`` only.

        Args:
            longest: the largest of ``lengths``, if the caller knows it (else read here).

        Raises:
            ValueError: if a sample is longer than ``max_length``.
        """
        lengths = lengths.to(torch.int64)
        if longest is None:
            longest = int(lengths.max()) if lengths.numel() else 0
        if longest > self.config.max_length:
            raise ValueError(f"a history of {longest} items exceeds max_length")
        offsets = _offsets(lengths)
        starts = torch.repeat_interleave(offsets[:-1], lengths, output_size=items.shape[0])
        positions = torch.arange(items.shape[0], device=items.device) - starts
        # SASRec's scaling: the item rows start small (uniform in +-sqrt(1/rows)).
        x = items * math.sqrt(self.config.embedding_dim) + self.positions(positions)
        for block in self.blocks:
            x = block(x, offsets, longest)
        return self.norm(x)

    def forward(self, batch: JaggedBatch) -> torch.Tensor:
        """Per-sample training losses ``[B]`` (float32), looking the batch up in the collection.

        Sample ``b``'s loss is the sum over its positions ``i = 0 .. L-2`` of the cross entropy
        of logits ``[h_i · e(history[i+1]), h_i · e(neg_1), ..., h_i · e(neg_K)]`` with label 0,
        where a negative equal to the positive gets ``-inf``. An empty batch gives an empty
        tensor whose backward still reaches every dense parameter and the collection (so that
        every rank runs the same collectives).
        """
        embedded = self.embeddings(batch)
        history, negatives = embedded["history"], embedded["negatives"]
        if batch.batch_size == 0:
            return self._empty_losses(history.values, negatives.values)
        ids = batch.features["history"].values
        lengths = history.lengths.to(torch.int64)
        samples = lengths.numel()
        # Every length the step needs on the host, in one read (each read waits for the GPU).
        host = torch.cat([lengths, negatives.lengths.to(torch.int64)]).tolist()
        host_counts = [length - 1 for length in host[:samples]]
        if min(host_counts) < 1:
            raise ValueError("every history needs at least 2 items (one target)")
        counts = lengths - 1
        positions = sum(host_counts)
        sample = torch.repeat_interleave(
            torch.arange(samples, device=ids.device), counts, output_size=positions
        )
        # Position i predicts item i+1: the inputs drop each sample's last item, the targets
        # its first (sample s's j-th input is item j + s of the batch).
        inputs = torch.arange(positions, device=ids.device) + sample
        hidden = self.encode(history.values[inputs], counts, max(host_counts))
        targets = history.values[inputs + 1]
        target_ids = ids[inputs + 1]
        positive = (hidden * targets).sum(-1)
        negative_rows = fixed_width(negatives, "negatives", host[samples:])
        negative_ids = fixed_width(batch.features["negatives"], "negatives", host[samples:])
        # One product per sample with its own negatives: exact work, and a sample's logits
        # are computed the same way whatever else is in the batch.
        negative_logits = torch.cat(
            [h @ rows.T for h, rows in zip(hidden.split(host_counts), negative_rows, strict=True)]
        )
        collides = negative_ids[sample] == target_ids[:, None]
        logits = torch.cat(
            [positive[:, None], negative_logits.masked_fill(collides, -math.inf)], dim=1
        )
        losses = torch.logsumexp(logits, dim=1) - positive
        return _per_sample_sums(losses, sample, counts, max(host_counts))

    @torch.no_grad()
    def score(self, batch: JaggedBatch, item_weights: torch.Tensor) -> torch.Tensor:
        """Scores ``[B, C]`` of each sample's candidates (for evaluation, no collectives).

        Args:
            batch: histories and ``candidates`` (the same number per sample).
            item_weights: the whole item table ``[num_items, dim]``, e.g.
                ``collection.state_dict(full=True)["tables.items.weight"]``; histories and
                candidates are read from it directly.

        Returns:
            The last position's hidden state dotted with each candidate's row.
        """
        history = batch.features["history"]
        candidates = fixed_width(batch.features["candidates"], "candidates")
        hidden = self.encode(item_weights[history.values], history.lengths)
        last = hidden[_offsets(history.lengths.to(torch.int64))[1:] - 1]
        rows = item_weights[candidates]
        return torch.bmm(rows, last.unsqueeze(-1)).squeeze(-1)

    def _empty_losses(self, *embedded: torch.Tensor) -> torch.Tensor:
        # A rank with no samples must still run DDP's gradient all-reduce (every parameter needs
        # a gradient) and the collection's backward exchange: a zero that depends on all.
        anchor = sum(p.sum() for p in self.parameters()) + sum(e.sum() for e in embedded)
        return torch.zeros(0, device=embedded[0].device) + 0 * anchor


def _per_sample_sums(
    values: torch.Tensor, sample: torch.Tensor, counts: torch.Tensor, longest: int
) -> torch.Tensor:
    # Padded to [B, longest] (one float per position) and summed along rows: deterministic on
    # every device, where CUDA's index_add_ would add with atomics in a varying order.
    within = torch.arange(values.shape[0], device=values.device) - _offsets(counts)[sample]
    padded = values.new_zeros(counts.numel(), longest)
    return padded.index_put((sample, within), values).sum(1)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def _check_table(config: SASRecConfig, embeddings: ShardedEmbeddingCollection) -> None:
    tables = {table.name: table for table in embeddings.table_configs}
    table = tables.get(config.table_name)
    if table is None:
        raise ValueError(f"the embedding collection has no table {config.table_name!r}")
    missing = {"history", "negatives"} - set(table.feature_names)
    if missing:
        raise ValueError(f"table {table.name!r} must be read by the features {sorted(missing)}")
    if (table.num_embeddings, table.embedding_dim) != (config.num_items, config.embedding_dim):
        raise ValueError(
            f"table {table.name!r} is {table.num_embeddings} x {table.embedding_dim}, the model "
            f"needs {config.num_items} x {config.embedding_dim}"
        )
