"""Part 3, kernels: the CUDA kernels the profiler sees per backend while its collectives run."""

from __future__ import annotations

import time
from typing import Any

from .context import Ctx, allgather, barrier, collective, describe_error, pattern, views
from .settings import MIB


def run_kernels(ctx: Ctx, deadline: float) -> dict[str, Any]:
    """Part 3: CUDA kernels and copies per collective and backend, from the profiler (rank 0)."""
    import torch

    if not ctx.cuda:
        return {"skipped": "CPU dry run"}
    from torch.profiler import ProfilerActivity, profile

    numel = MIB  # 4 MiB of float32
    base_in = pattern(ctx.rank, 0, numel, ctx.dev)
    base_out = torch.empty(numel, device=ctx.dev)
    result = {}
    for backend in ctx.backends():
        group = ctx.groups[backend]
        ctx.progress("kernels", backend)
        barrier(ctx)
        try:
            a_in, a_out = views(ctx, backend, base_in, base_out)
            inputs = {"all_to_all_single": a_in, "all_gather_into_tensor": a_in[: numel // ctx.n]}
            local: Any = {}
            for op, op_in in inputs.items():
                collective(op, group, a_out, op_in)
                torch.cuda.synchronize(ctx.dev)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(2):
                        collective(op, group, a_out, op_in)
                    torch.cuda.synchronize(ctx.dev)
                kernels, copies = [], []
                for evt in prof.events():
                    if evt.device_type != torch.autograd.DeviceType.CUDA:
                        continue
                    is_copy = evt.name.startswith(("Memcpy", "Memset", "Memop", "cuStream"))
                    (copies if is_copy else kernels).append(evt.name)
                local[op] = {
                    "kernels_per_op": len(kernels) / 2,
                    "memcpys_per_op": len(copies) / 2,
                    "kernel_names": sorted(set(kernels))[:6],
                    "copy_names": sorted(set(copies))[:6],
                }
        except Exception as err:
            local = {"error": describe_error(err)}
        result[backend] = allgather(ctx, local)
        if time.time() > deadline:
            result["skipped"] = "time budget"
            break
    return result
