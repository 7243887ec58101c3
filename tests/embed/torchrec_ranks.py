"""TorchRec 1.8's row-wise sharded ``EmbeddingCollection`` on the same steps, on each rank.

TorchRec runs over the test's Gloo group with its fused CPU kernel (``compute_kernel="fused"``:
the default dense CPU kernel of TorchRec 1.8 returns too few rows for sequence lookups and
corrupts the heap in the output AllToAll). Its gradient division by world size is switched off,
so both train on the sum of the ranks' gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from freescale_embed import SGD, RowWiseAdagrad, TableConfig
from freescale_embed.workload import make_batch
from tests.embed.ranks import Case, train
from tests.embed.reference import loss_weights


def _sharded_collection(tables: tuple[TableConfig, ...], optimizer: Any) -> Any:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan

    from benchmarks.train_torchrec import row_wise_collection

    if not isinstance(optimizer, (SGD, RowWiseAdagrad)):
        raise AssertionError(f"no TorchRec comparison for {optimizer}")
    module, sharder, plan = row_wise_collection(tables, optimizer)
    return DistributedModelParallel(
        module,
        device=torch.device("cpu"),
        plan=ShardingPlan({"": plan}),
        sharders=[sharder],
        init_data_parallel=False,
    )


def _gather_full(model: Any, tables: tuple[TableConfig, ...]) -> dict[str, torch.Tensor]:
    from benchmarks.train_torchrec import _local_shards

    pieces: list[Any] = [None] * dist.get_world_size()
    local = {name: (start, rows.clone()) for name, (start, rows) in _local_shards(model).items()}
    dist.all_gather_object(pieces, local)
    full = {}
    for table in tables:
        out = torch.zeros(table.num_embeddings, table.embedding_dim)
        for piece in pieces:
            start, rows = piece[table.name]
            out[start : start + rows.shape[0]] = rows
        full[table.name] = out
    return full


def torchrec_agrees(case: Case) -> dict[str, float]:
    """Our sync run equals TorchRec's sharded run, outputs and tables, to float32 rounding."""
    from torchrec.distributed import comm_ops

    from benchmarks.train_torchrec import _local_shards

    rank, world = dist.get_rank(), dist.get_world_size()
    ours = train(case, "sync")
    comm_ops.set_gradient_division(False)
    try:
        model = _sharded_collection(case.tables, case.optimizer)
        with torch.no_grad():
            for name, (start, rows) in _local_shards(model).items():
                rows.copy_(ours.initial[name][start : start + rows.shape[0]])
        workload = case.workload(world)
        worst = 0.0
        for step in range(case.steps):
            batch = make_batch(workload, rank, step)
            out = model(batch.to_keyed_jagged_tensor()).wait()
            values = [out[name].values() for name in batch.features]
            for name, value in zip(batch.features, values, strict=True):
                torch.testing.assert_close(ours.outputs[step][name], value.detach())
                if value.numel():
                    worst = max(
                        worst, float((ours.outputs[step][name] - value.detach()).abs().max())
                    )
            weights = loss_weights(rank, step, [v.shape for v in values])
            sum((v * w).sum() for v, w in zip(values, weights, strict=True)).backward()
        theirs = _gather_full(model, case.tables)
    finally:
        comm_ops.set_gradient_division(True)
    for table in case.tables:
        got = ours.full[f"tables.{table.name}.weight"]
        worst = max(worst, float((got - theirs[table.name]).abs().max()))
        torch.testing.assert_close(got, theirs[table.name], rtol=1e-5, atol=1e-6)
    return {"worst_abs_diff": worst}
