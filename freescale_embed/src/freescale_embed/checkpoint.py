"""Checkpoints of a ``TrainPipeline`` through ``torch.distributed.checkpoint``, on any world size.

A checkpoint holds every collection's table shards and their optimizer state as row-wise
``DTensor``s (``Shard(0)``: the collection's ``ceil(rows / world)`` blocks are exactly
``torch.chunk``'s), the dense model and its optimizer (replicated, written once), the
balancer's tuned VBS exponent and the pipeline's step, which is also the position of a loader
that yields global batches by index. Loading on another world size re-shards the tables; the
next step looks its rows up afresh (its prefetch state is dropped).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from freescale_embed.collection import ShardedEmbeddingCollection
from freescale_embed.pipeline import TrainPipeline


def _table_tensors(prefix: str, collection: ShardedEmbeddingCollection) -> dict[str, torch.Tensor]:
    """This rank's row blocks of every table buffer as ``DTensor``s over the collection's group."""
    mesh = DeviceMesh.from_group(collection.group, collection.device.type)
    tensors: dict[str, torch.Tensor] = {}
    for name, table in collection.tables.named_shards():
        rows = table.config.num_embeddings
        for buffer in ("weight", *table.state_names):
            local = getattr(table, buffer)
            shape = (rows, *local.shape[1:])
            stride = torch.empty(shape, device="meta").stride()
            tensors[f"{prefix}tables.{name}.{buffer}"] = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride
            )
    return tensors


def _state(pipeline: TrainPipeline) -> dict[str, Any]:
    sharded: dict[str, torch.Tensor] = {}
    steps: dict[str, torch.Tensor] = {}
    for name, collection in pipeline.collections.items():
        prefix = f"{name}." if name else ""
        collection.synchronize()
        sharded.update(_table_tensors(prefix, collection))
        steps[f"{prefix}step"] = collection.step.detach().clone()
    # The collections' own entries are saved above, as shards; a model that is itself a
    # collection has no dense part.
    sharded_prefixes = tuple(f"{n}." for n in pipeline.collections if n)
    dense = {
        key: value
        for key, value in pipeline.model.state_dict().items()
        if "" not in pipeline.collections and not key.startswith(sharded_prefixes)
    }
    optimizer = get_optimizer_state_dict(
        pipeline.model, pipeline.optimizer, options=StateDictOptions(ignore_frozen_params=True)
    )
    meta = {"step": pipeline.step, "world_size": pipeline.world_size}
    if pipeline.balancer is not None:
        meta["vbs_tuner"] = pipeline.balancer.tuner.state_dict()
    return {
        "embeddings": sharded,
        "embedding_steps": steps,
        "dense": dense,
        "optimizer": optimizer,
        "meta": meta,
    }


def save(directory: str | Path, pipeline: TrainPipeline) -> None:
    """Writes ``pipeline``'s state to ``directory`` (collective: call on every rank between
    steps)."""
    dcp.save(_state(pipeline), checkpoint_id=str(directory), process_group=pipeline.status_group)


def load(directory: str | Path, pipeline: TrainPipeline) -> dict[str, Any]:
    """Restores ``pipeline`` from ``directory``, written on any world size (collective).

    Returns:
        The checkpoint's ``meta``: ``step`` (where the loader resumes, in global batches),
        ``world_size`` it was written on, and ``vbs_tuner`` (the VBS exponent and its window of
        measured steps) when a balancer was saved.
    """
    state = _state(pipeline)
    dcp.load(state, checkpoint_id=str(directory), process_group=pipeline.status_group)
    for name, collection in pipeline.collections.items():
        prefix = f"{name}." if name else ""
        local = {
            key[len(prefix) :]: tensor.to_local()
            for key, tensor in state["embeddings"].items()
            if key.startswith(prefix)
        }
        local["step"] = state["embedding_steps"][f"{prefix}step"]
        collection.load_state_dict(local)
    pipeline.model.load_state_dict(state["dense"], strict=False)
    set_optimizer_state_dict(
        pipeline.model,
        pipeline.optimizer,
        state["optimizer"],
        options=StateDictOptions(ignore_frozen_params=True),
    )
    meta = state["meta"]
    pipeline.step = int(meta["step"])
    if pipeline.balancer is not None and "vbs_tuner" in meta:
        pipeline.balancer.tuner.load_state_dict(meta["vbs_tuner"])
    return meta
