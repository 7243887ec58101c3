"""Data for ``freescale train``: synthetic and MovieLens-100K batches in global-batch order.

Training batches carry ``history`` (time-ordered item IDs, the held-out item excluded) and
``negatives`` (``num_negatives`` per sample) features and ``sample_id`` / ``user_id`` dense
fields; evaluation batches carry ``history`` and ``candidates`` (the held-out item, then 100
items the user never interacted with).
"""

from freescale_embed.data.movielens import (
    MovieLens,
    MovieLensConfig,
    load_movielens,
    movielens_batches,
    movielens_eval_batches,
    movielens_path,
)
from freescale_embed.data.synthetic import (
    SyntheticConfig,
    SyntheticDataset,
    synthetic_batches,
    synthetic_eval_batches,
    synthetic_item_counts,
)

__all__ = [
    "MovieLens",
    "MovieLensConfig",
    "SyntheticConfig",
    "SyntheticDataset",
    "load_movielens",
    "movielens_batches",
    "movielens_eval_batches",
    "movielens_path",
    "synthetic_batches",
    "synthetic_eval_batches",
    "synthetic_item_counts",
]
