"""Part 6, embed (parent side): freescale_embed's own benchmark once per backend."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import time
from typing import Any

from .context import describe_error


def run_embed(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """freescale_embed's own benchmark (it starts its ranks itself), once per backend, where its
    API can run it on the GPUs over a chosen backend; otherwise says why it was not run."""
    try:
        bench = importlib.import_module("freescale_embed.bench")
    except Exception as err:
        return {"status": f"not run: freescale_embed not available ({type(err).__name__}: {err})"}
    config_cls, run = getattr(bench, "BenchConfig", None), getattr(bench, "run_bench", None)
    if config_cls is None or run is None:
        return {
            "status": "not run: freescale_embed.bench has no BenchConfig / run_bench",
            "attributes": sorted(a for a in dir(bench) if not a.startswith("_")),
        }
    if args.share_gpu:
        return {"status": "not run: its ranks take a GPU each (--share-gpu)"}
    fields = {f.name for f in dataclasses.fields(config_cls)}
    if "backend" not in fields:
        return {
            "status": "not run: freescale_embed.bench cannot run on the GPUs over a chosen "
            "backend yet (BenchConfig has no 'backend' field; its ranks use Gloo "
            "on CPU)",
            "bench_config_fields": sorted(fields),
        }
    results: dict[str, Any] = {"status": "run", "bench_config_fields": sorted(fields)}
    # On the GPUs the dense phase is bf16 matmuls on the training stream (the GPU busy, the CPU
    # free), as in a real step; the dry run sleeps instead.
    wanted = {
        "world_size": args.nprocs,
        "steps": args.embed_steps,
        "warmup": 3,
        "collision_rates": (0.0, 0.01, 0.05, 0.2),
        "device": "cpu" if args.dry_run else "cuda",
        "dense": "sleep" if args.dry_run else "gpu",
        "dense_ms": 100.0,
    }
    timeout_ok = "timeout_s" in inspect.signature(run).parameters
    for backend in ("freescale", "nccl"):
        left = deadline - time.time()
        if left < 30:
            results[backend] = {"skipped": f"time budget ({left:.0f} s left)"}
            continue
        kwargs = {k: v for k, v in wanted.items() if k in fields}
        kwargs["backend"] = "gloo" if args.dry_run and backend == "nccl" else backend
        t0 = time.time()
        try:
            report = run(config_cls(**kwargs), **({"timeout_s": left - 10} if timeout_ok else {}))
            results[backend] = {"config": kwargs, "report": _jsonable(report)}
        except Exception as err:
            results[backend] = {"config": kwargs, "error": describe_error(err)}
        results[backend]["seconds"] = round(time.time() - t0, 1)
    return results


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        if isinstance(value, dict):
            return {str(k): _jsonable(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [_jsonable(v) for v in value]
        if hasattr(value, "__dict__"):
            return _jsonable(vars(value))
        return repr(value)
