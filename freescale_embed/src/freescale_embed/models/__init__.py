"""The reference sequence recommender (SASRec) and its jagged causal attention."""

from freescale_embed.models.attention import (
    jagged_causal_attention,
    jagged_causal_attention_torch,
    jagged_causal_attention_varlen,
)
from freescale_embed.models.sasrec import (
    SASRec,
    SASRecConfig,
    cost_model,
    fixed_width,
    item_tables,
    target_counts,
)

__all__ = [
    "SASRec",
    "SASRecConfig",
    "cost_model",
    "fixed_width",
    "item_tables",
    "jagged_causal_attention",
    "jagged_causal_attention_torch",
    "jagged_causal_attention_varlen",
    "target_counts",
]
