"""A rank's side of a phase: its groups, then one part per launcher run."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

from .context import Ctx, describe_error, time_ok
from .correctness import run_correctness
from .environment import run_setup
from .kernels import run_kernels
from .overlap import run_overlap
from .settings import SAFE_ENV, SECTION_CAP, SECTION_MIN, SRC_DIRS
from .sweep import run_sweep

SECTIONS = {
    "setup": run_setup,
    "correctness": run_correctness,
    "kernels": run_kernels,
    "sweep": run_sweep,
    "overlap": run_overlap,
}


# This rank's state between the launcher's runs (``init_rank`` makes it).
_CTX: Ctx | None = None


def init_rank(
    args: argparse.Namespace, phase: dict[str, Any], deadline: float, progress: str
) -> None:
    """Joins this rank's groups on the launcher's store: the default group freescale on the
    direct path, freescale IPC and staged, Gloo for the benchmark's own agreements, NCCL (Gloo
    in a dry run; none with ``--share-gpu``). Raises if one cannot be made (the launcher
    reports it and stops the others)."""
    global _CTX
    from freescale_comm._local_ranks import local_rank, store_port

    os.environ.update(SAFE_ENV)
    os.environ.update(phase["env"])
    for path in reversed(SRC_DIRS):
        if path.is_dir() and str(path) not in sys.path:
            sys.path.insert(0, str(path))
    sys.setswitchinterval(0.0005)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch
    import torch.distributed as dist

    rank = local_rank()
    cuda = not args.dry_run
    if cuda:
        index = 0 if args.share_gpu else rank
        torch.cuda.set_device(index)
        dev = torch.device("cuda", index)
        # Every backend is called from a stream of its own, not the legacy default stream:
        # torch runs a synchronous NCCL collective on the caller's stream, and NCCL 2.28.9's
        # copy-engine path hands that stream to cudaMemcpyBatchAsync, which rejects the legacy
        # one ("Cuda failure 'invalid argument'", ce_coll.cc:341, in the first two-GPU runs;
        # NCCL 2.30's ncclCeLaunchBatchOps falls back to per-copy cudaMemcpyAsync there).
        torch.cuda.set_stream(torch.cuda.Stream(dev))
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(1)
    ctx = Ctx(
        rank=rank,
        n=args.nprocs,
        dev=dev,
        cuda=cuda,
        args=args,
        phase=phase,
        deadline=deadline,
        progress_path=progress if rank == 0 else None,
    )
    timeout = timedelta(seconds=args.group_timeout)
    import freescale_comm
    from freescale_comm import FreescaleOptions

    freescale_comm.register()
    store = dist.TCPStore("127.0.0.1", store_port(), is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "freescale",
        store=store,
        rank=rank,
        world_size=args.nprocs,
        timeout=timeout,
        pg_options=FreescaleOptions(cuda_path="direct"),
    )
    ctx.groups["fs_direct"] = dist.group.WORLD
    ctx.groups["fs_ipc"] = dist.new_group(
        backend="freescale", timeout=timeout, pg_options=FreescaleOptions(cuda_path="ipc")
    )
    ctx.groups["fs_staged"] = dist.new_group(
        backend="freescale", timeout=timeout, pg_options=FreescaleOptions(cuda_path="staged")
    )
    ctx.gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
    if not args.share_gpu:  # NCCL refuses two ranks on one GPU
        ctx.nccl = dist.new_group(backend="gloo" if args.dry_run else "nccl", timeout=timeout)
    for backend in phase["backends"]:
        if backend.startswith("nccl") and backend != "nccl_ce":  # nccl_ce: once set up
            ctx.groups[backend] = ctx.nccl
    _CTX = ctx


def run_section(name: str, reserve_s: float) -> tuple[Any, float] | None:
    """Runs one part within its cap and the phase's deadline less ``reserve_s`` (what the later
    parts need at least). Returns (result, seconds) on rank 0 and where the part failed, as
    plain JSON data; ``None`` elsewhere."""
    ctx = _CTX
    if ctx is None:
        raise RuntimeError("run_section before init_rank")
    end = min(ctx.deadline - reserve_s, time.time() + SECTION_CAP[name] * ctx.args.cap_scale)
    t0 = time.time()
    if not time_ok(ctx, SECTION_MIN[name], end):
        payload: Any = {"skipped": "time budget"}
    else:
        try:
            payload = SECTIONS[name](ctx, end)
        except Exception as err:
            payload = {"error": describe_error(err)}
    seconds = round(time.time() - t0, 1)
    if ctx.rank == 0:
        print(f"[{ctx.phase['name']}] {name} done in {seconds} s", flush=True)
    if ctx.rank == 0 or (isinstance(payload, dict) and "error" in payload):
        return json.loads(json.dumps(payload, default=str)), seconds
    return None


def finish_rank() -> str | None:
    """Destroys this rank's groups; the error, if that failed."""
    import torch.distributed as dist

    try:
        dist.destroy_process_group()
        return None
    except Exception as err:
        print(f"rank {_CTX.rank if _CTX else '?'}: destroy_process_group: {err}", flush=True)
        return describe_error(err)
