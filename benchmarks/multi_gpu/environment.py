"""Part 1, setup: versions, GPU links, one collective per group, each pair's path, the
symmetric buffers of ``nccl_ce``."""

from __future__ import annotations

import os
import subprocess
from typing import Any

from .context import Ctx, allgather, describe_error
from .settings import FREESCALE, KIB


def run_setup(ctx: Ctx, deadline: float) -> dict[str, Any]:
    """Part 1: what each rank runs on, a collective per group, the paths, ``nccl_ce``'s buffers."""
    import torch
    import torch.distributed as dist

    info: dict[str, Any] = {"rank": ctx.rank, "device": str(ctx.dev), "pid": os.getpid()}
    info["env"] = {
        k: v
        for k, v in sorted(os.environ.items())
        if k.startswith(
            ("NCCL_", "FREESCALE_", "UCX_", "TORCH_NCCL", "TORCH_SYMM", "NVSHMEM_", "CUDA_VISIBLE")
        )
    }
    if ctx.cuda:
        info["gpu"] = torch.cuda.get_device_name(ctx.dev)
        info["nccl_runtime"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["peer_access"] = {
            j: torch.cuda.can_device_access_peer(ctx.dev.index, j)
            for j in range(torch.cuda.device_count())
            if j != ctx.dev.index
        }
        try:
            if ctx.nccl is None:
                info["nccl_build"] = "no NCCL group (--share-gpu)"
            else:
                backend = ctx.nccl._get_backend(torch.device("cuda"))
                info["nccl_build"] = ".".join(map(str, backend.get_build_nccl_version()))
        except Exception as err:
            info["nccl_build"] = f"unknown ({type(err).__name__})"
        try:
            config = dist.ProcessGroupNCCL.NCCLConfig()
            info["torch_nccl_config_fields"] = sorted(
                a for a in dir(config) if not a.startswith("_")
            )
            info["torch_nccl_config_has_cta_policy"] = hasattr(config, "cta_policy")
        except Exception as err:
            info["torch_nccl_config_fields"] = describe_error(err)
    # Both kinds of group in one process: one small collective on each.
    checks: dict[str, Any] = {}
    x = torch.full((4,), float(ctx.rank + 1), device=ctx.dev)
    if ctx.nccl is not None:
        ctx.progress("setup", "nccl")
        try:
            dist.all_reduce(x, group=ctx.nccl)
            checks["nccl_all_reduce"] = bool(torch.all(x == ctx.n * (ctx.n + 1) / 2))
        except Exception as err:
            checks["nccl_all_reduce"] = describe_error(err)
    for name in (b for b in FREESCALE if b in ctx.backends()):
        ctx.progress("setup", name)
        try:
            out = torch.empty(4 * ctx.n, device=ctx.dev)
            dist.all_gather_into_tensor(
                out, torch.full((4,), float(ctx.rank), device=ctx.dev), group=ctx.groups[name]
            )
            want = torch.arange(ctx.n, device=ctx.dev).float().repeat_interleave(4)
            checks[f"{name}_all_gather"] = bool(torch.equal(out, want))
        except Exception as err:
            checks[f"{name}_all_gather"] = describe_error(err)
        # Which path each peer takes and why (fs_staged: the staging rings on one host).
        info[f"{name}_paths"] = [
            {k: row[k] for k in ("peer", "path", "cuda")} for row in ctx.groups[name].paths()
        ]
    info["group_checks"] = checks
    if "nccl_ce" in ctx.phase["backends"]:
        ctx.progress("setup", "nccl_ce")
        info["nccl_ce"] = _setup_symmetric(ctx)
        if not all(allgather(ctx, "nccl_ce" in ctx.arenas)):  # every rank runs it, or none
            ctx.groups.pop("nccl_ce", None)
            ctx.arenas.pop("nccl_ce", None)
    if ctx.rank == 0:
        info["freescale_comm"] = _freescale_info()
        info["topology"] = _run_text(["nvidia-smi", "topo", "-m"]) if ctx.cuda else "cpu"
        if ctx.cuda:
            info["nvlink_status"] = _run_text(["nvidia-smi", "nvlink", "-s"])[:3000]
    per_rank = allgather(ctx, info)
    return {
        "ranks": per_rank,
        "all_groups_ok": all(v is True for r in per_rank for v in r["group_checks"].values()),
    }


def _setup_symmetric(ctx: Ctx) -> str:
    """Buffers for ``nccl_ce``: two arenas in NCCL symmetric windows of the NCCL group
    (ncclCommWindowRegister with NCCL_WIN_COLL_SYMMETRIC): torch's NCCL symmetric memory, or
    else a MemPool on NCCL's allocator registered with ``register_mem_pool(pool, symm=True)``."""
    import torch

    if not ctx.cuda:
        ctx.groups.pop("nccl_ce", None)
        return "skipped: needs CUDA (dry run)"
    args = ctx.args
    in_bytes = max([args.max_bytes, *args.overlap_sizes]) + 4 * KIB
    tried = []
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NCCL")
        arenas = (
            symm_mem.empty(in_bytes, dtype=torch.uint8, device=ctx.dev),
            symm_mem.empty(2 * in_bytes, dtype=torch.uint8, device=ctx.dev),
        )
        for arena in arenas:
            try:
                symm_mem.rendezvous(arena, ctx.nccl)
            except TypeError:
                symm_mem.rendezvous(arena, ctx.nccl.group_name)
        torch.cuda.synchronize(ctx.dev)
        ctx.arenas["nccl_ce"] = arenas
        ctx.groups["nccl_ce"] = ctx.nccl
        return f"ok (torch symmetric memory, NCCL backend): arenas {in_bytes} + {2 * in_bytes} B"
    except Exception as err:
        tried.append(f"symmetric memory: {describe_error(err)}")
    try:
        backend = ctx.nccl._get_backend(torch.device("cuda"))
        pool = torch.cuda.MemPool(backend.mem_allocator)
        with torch.cuda.use_mem_pool(pool):
            arenas = (
                torch.empty(in_bytes, dtype=torch.uint8, device=ctx.dev),
                torch.empty(2 * in_bytes, dtype=torch.uint8, device=ctx.dev),
            )
        backend.register_mem_pool(pool, symm=True)
        torch.cuda.synchronize(ctx.dev)
        ctx.arenas["nccl_ce"] = arenas
        ctx.groups["nccl_ce"] = ctx.nccl
        ctx.keep.append(pool)  # keeps the registration alive
        return (
            f"ok (MemPool on NCCL's allocator, register_mem_pool symm=True): arenas "
            f"{in_bytes} + {2 * in_bytes} B; first try failed: {tried[0][:300]}"
        )
    except Exception as err:
        tried.append(f"mem pool: {describe_error(err)}")
    ctx.groups.pop("nccl_ce", None)
    return "failed, nccl_ce dropped: " + " || ".join(tried)


def _freescale_info() -> Any:
    try:
        from freescale_comm.info import ucx_transports

        return {"ucx_transports": ucx_transports()}
    except Exception as err:
        return describe_error(err)


def _run_text(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
        return (done.stdout + done.stderr).strip()
    except Exception as err:
        return describe_error(err)
