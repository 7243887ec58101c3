"""Sync mode equals TorchRec 1.8's row-wise sharded EmbeddingCollection over the same Gloo group.

Both start from the same rows, see the same batches and losses, and train with the same fused
optimizer (TorchRec's gradient division by world size switched off); outputs of every step and
the final tables agree to float32 rounding (they sum gradients in different orders).
"""

from __future__ import annotations

import pytest

from freescale_embed import SGD, RowWiseAdagrad, TableConfig
from tests.embed import ranks, torchrec_ranks

pytest.importorskip("torchrec", reason="the TorchRec comparison needs torchrec + fbgemm-gpu-cpu")

# TorchRec's EmbeddingCollection needs one width for all tables, and names a table "items" at
# its peril (an nn.ModuleDict attribute).
TABLES = (
    TableConfig("item", 400, 8, ["history", "candidates"]),
    TableConfig("category", 61, 8, ["category"]),
)


@pytest.mark.parametrize(
    "world, optimizer, rate",
    [
        (2, SGD(lr=0.1), 0.05),
        (2, RowWiseAdagrad(lr=0.1), None),
        (4, RowWiseAdagrad(lr=0.1), 0.2),
        (4, SGD(lr=0.1), None),
    ],
    ids=["2ranks-sgd-5%", "2ranks-adagrad-zipf", "4ranks-adagrad-20%", "4ranks-sgd-zipf"],
)
def test_sync_matches_torchrec_sharded_embedding_collection(local_groups, world, optimizer, rate):
    case = ranks.Case(optimizer=optimizer, collision_rate=rate, tables=TABLES)
    results = local_groups.get(world).run(torchrec_ranks.torchrec_agrees, case, timeout_s=240)
    assert all(r["worst_abs_diff"] < 1e-5 for r in results)
