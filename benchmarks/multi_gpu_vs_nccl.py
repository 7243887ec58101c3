"""Multi-GPU head-to-head of freescale_comm against NCCL, in one call (issue 5).

One process per GPU, started here (spawn, a TCPStore on loopback). In each process the default
group is ``backend="freescale"`` forced to the direct CUDA path, a second freescale group forces
the staged path (both through ``FreescaleOptions`` as ``pg_options``), an NCCL group lives beside
them, and a Gloo group carries this script's own barriers and agreements. Each part runs in
try/except and inside a global time budget (parts that no longer fit are skipped and say so):

1. setup: versions, GPU links (``nvidia-smi topo -m``), a freescale and an NCCL group in one
   process, the path of each peer pair per freescale group (``paths()``: on one host the staged
   group moves CUDA bytes through the staging rings, page-locked shared memory), the symmetric
   buffers of the NCCL copy-engine variant;
2. correctness: every own collective of freescale (direct and staged) on CUDA tensors between the
   GPUs, float32 / bfloat16 / int64, against NCCL's result on the same inputs and the expected
   values;
3. kernels: CUDA kernels the profiler sees per backend while its collectives run;
4. sweep (nccl-tests style, 8 B .. 1 GiB by factor 2): all_gather_into_tensor, all_to_all_single
   even and uneven; freescale direct / staged, NCCL default, NCCL zero-CTA copy engine
   (``nccl_ce``: NCCL_CTA_POLICY=2 plus buffers in NCCL symmetric windows); time (CUDA events,
   median over iterations, slowest rank), algbw, busbw = algbw * (n-1)/n, correctness per size;
5. overlap: a bf16 8192^3 matmul and a jagged (varlen) flash attention, replayed from a CUDA graph,
   timed alone and while each backend moves 64 / 256 MiB AllToAll / AllGather concurrently on
   every rank; rounds alternated, medians, slowdown per backend and rank;
6. embed (from this parent process, between the phases): freescale_embed's own benchmark
   (``freescale_embed.bench.run_bench``, which starts its ranks itself) once with the freescale
   and once with the NCCL backend, where its BenchConfig can choose the backend; otherwise the
   JSON says why it was not run;
then, in a second set of processes (NCCL reads it once per process), NCCL with
NCCL_P2P_USE_CUDA_MEMCPY=1 (copy-engine P2P transport) for kernels, sweep and overlap.

What NCCL 2.28.9 offers (read from its source, tag v2.28.9-1, recorded in the JSON too):
``NCCL_CTA_POLICY`` / ``ncclConfig_t.CTAPolicy`` 0 default, 1 efficiency, 2 zero
(``NCCL_CTA_POLICY_ZERO`` is the constant, not a variable). With 2, AllGather and AlltoAll (the
``ncclAlltoAll`` API) run on copy engines when the communicator is single-node with symmetric
support and both buffers lie in windows registered with NCCL_WIN_COLL_SYMMETRIC
(src/enqueue.cc, src/ce_coll.cc); the policy changes nothing else, so the plain ``nccl`` backend
(cudaMalloc buffers) still runs NCCL's default kernels in the same process. Uneven AllToAll is
send/recv there: no copy-engine path.

Writes multi_gpu_vs_nccl.json (rewritten after every part), table.txt, and sweep.png /
overlap.png where matplotlib imports, under --out (default $OUT or out/multi_gpu); prints a short
table last. ``--dry-run`` runs the same structure on CPU (Gloo stands in for NCCL, tiny sizes).

    python benchmarks/multi_gpu_vs_nccl.py --out $OUT          # on the 2-GPU machine
    python benchmarks/multi_gpu_vs_nccl.py --dry-run            # anywhere, CPU only
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import multiprocessing
import os
import queue as queue_lib
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
ROOT = Path(__file__).resolve().parents[1]
SRC_DIRS = [
    ROOT / name / "src"
    for name in ("freescale_comm", "freescale_balance", "freescale_embed", "kernels")
]
# NVLink multicast stays off in every process (a program using it can take the host's GPUs out
# of service): ../shared/GPU.md and the device's KINDS.md.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
OPS = ("all_gather_into_tensor", "all_to_all_single", "all_to_all_single_uneven")
OVERLAP_OPS = ("all_to_all_single", "all_gather_into_tensor")
FREESCALE = ("fs_direct", "fs_staged")
JSON_NAME = "multi_gpu_vs_nccl.json"
TARGET_PCT, TARGET_GAP = 2.0, 5.0

PHASES: list[dict[str, Any]] = [
    {
        "name": "main",
        "env": {"NCCL_CTA_POLICY": "2"},
        "backends": ["fs_direct", "fs_staged", "nccl", "nccl_ce"],
        "sections": ["setup", "correctness", "kernels", "sweep", "overlap"],
    },
    {
        "name": "nccl_p2p_memcpy",
        "env": {"NCCL_P2P_USE_CUDA_MEMCPY": "1"},
        "backends": ["nccl_p2p_memcpy"],
        "sections": ["setup", "kernels", "sweep", "overlap"],
    },
]
# Upper bound (s) of each part, and what it needs at least to start.
SECTION_CAP = {
    "setup": 90,
    "correctness": 90,
    "kernels": 60,
    "sweep": 170,
    "overlap": 160,
    "embed": 150,
}
SECTION_MIN = {"setup": 5, "correctness": 10, "kernels": 5, "sweep": 15, "overlap": 20, "embed": 15}
PHASE_MIN_S = 75  # a later phase starts only with this much budget left

NCCL_FACTS = {
    "version_read": "NVIDIA/nccl tag v2.28.9-1",
    "NCCL_CTA_POLICY": "env var (src/init.cc NCCL_PARAM CtaPolicy) overriding ncclConfig_t."
    "CTAPolicy: 0 default, 1 efficiency, 2 zero",
    "NCCL_CTA_POLICY_ZERO": "a constant of nccl.h (value 2), not an environment variable",
    "copy_engine_collectives": "AllGather, AlltoAll (ncclAlltoAll API), Gather, Scatter run as "
    "copy-engine collectives when CTAPolicy==ZERO, single node, "
    "comm->symmetricSupport (all CUDA P2P, cuMem, NCCL_WIN_ENABLE=1), "
    "send and recv buffers in NCCL_WIN_COLL_SYMMETRIC windows, driver "
    ">= 12.5 (src/enqueue.cc, src/ce_coll.cc)",
    "uneven_alltoall": "send/recv in 2.28.9: no copy-engine path",
    "policy_scope": "CTAPolicy is only consulted for windowed buffers (zero) and for the "
    "efficiency policy, so NCCL_CTA_POLICY=2 leaves collectives on plain "
    "cudaMalloc buffers on NCCL's default kernels",
    "NCCL_P2P_USE_CUDA_MEMCPY": "env var (src/transport/p2p.cc): P2P transport data moved by "
    "cudaMemcpy in the proxy thread (copy engines); kernels still "
    "run the protocol; process-wide, hence its own phase",
    "zero_sm_2_30": "NCCL 2.30's zero-SM AllGather/AlltoAll is not in 2.28.9",
}


# ====================================================================== small helpers
def _err(err: BaseException) -> str:
    tail = traceback.format_exception(type(err), err, err.__traceback__)[-3:]
    return (f"{type(err).__name__}: {err}"[:1500] + " | " + "".join(tail)[-800:]).strip()


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": KIB, "M": MIB, "G": GIB}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def fmt_size(nbytes: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _sizes(lo: int, hi: int, factor: int) -> list[int]:
    sizes, size = [], max(1, lo)
    while size <= hi:
        sizes.append(size)
        size *= max(2, factor)
    return sizes


def _uneven(count: int, n: int) -> list[list[int]]:
    """Element counts c[src][dst], each row summing to ``count``; skewed, zeros for tiny counts."""
    rows = []
    for src in range(n):
        weights = [1 + (src + 2 * dst) % (n + 1) for dst in range(n)]
        row = [count * w // sum(weights) for w in weights]
        row[-1] += count - sum(row)
        rows.append(row)
    return rows


def _geometry(op: str, nbytes: int, n: int, rank: int) -> tuple[int, int, int, Any]:
    """(elements of the nccl-tests "size", input numel, output numel, splits) of float32 data."""
    count = max(n, (nbytes // 4) // n * n)
    if op == "all_gather_into_tensor":
        return count, count // n, count, None
    if op == "all_to_all_single":
        return count, count, count, None
    c = _uneven(count, n)
    out_splits = [c[src][rank] for src in range(n)]
    return count, count, sum(out_splits), (out_splits, c[rank])


# ====================================================================== rank side
@dataclass
class Ctx:
    rank: int
    n: int
    dev: Any
    cuda: bool
    args: argparse.Namespace
    phase: dict[str, Any]
    gloo: Any = None
    nccl: Any = None
    groups: dict[str, Any] = field(default_factory=dict)
    arenas: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    keep: list[Any] = field(default_factory=list)
    send: Any = None
    _last: Any = None

    def backends(self) -> list[str]:
        return [b for b in self.phase["backends"] if b in self.groups]

    def progress(self, section: str, backend: str) -> None:
        """Tells the parent (rank 0 only) which backend runs now: if this process dies, the
        parent retries the rest of the phase without that backend."""
        if os.environ.get("MULTI_GPU_BENCH_CRASH") == f"{section}:{backend}" and self.rank == 1:
            os._exit(3)  # test hook for the retry path (dry runs only)
        if self.rank == 0 and self.send is not None and (section, backend) != self._last:
            self._last = (section, backend)
            self.send("progress", section, backend)


def _sync(ctx: Ctx) -> None:
    import torch

    if ctx.cuda:
        torch.cuda.synchronize(ctx.dev)


def _barrier(ctx: Ctx) -> None:
    import torch.distributed as dist

    dist.barrier(group=ctx.gloo)


def _allgather(ctx: Ctx, obj: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * ctx.n
    dist.all_gather_object(out, obj, group=ctx.gloo)
    return out


def _time_ok(ctx: Ctx, need_s: float, deadline: float) -> bool:
    """Whether every rank still has ``need_s`` before ``deadline`` (all ranks decide alike)."""
    return all(_allgather(ctx, time.time() + need_s <= deadline))


def _pattern(src: int, start: int, count: int, dev: Any) -> Any:
    """float32 values that name their source rank and index (exact in float32)."""
    import torch

    idx = torch.arange(start, start + count, device=dev, dtype=torch.int32)
    return ((idx + src * 7919) % 65521).to(torch.float32)


def _collective(
    op: str, group: Any, out: Any, inp: Any, splits: Any = None, async_op: bool = False
) -> Any:
    import torch.distributed as dist

    if op == "all_gather_into_tensor":
        return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)
    if op == "all_to_all_single":
        return dist.all_to_all_single(out, inp, group=group, async_op=async_op)
    if op == "all_to_all_single_uneven":
        out_splits, in_splits = splits
        return dist.all_to_all_single(
            out, inp, out_splits, in_splits, group=group, async_op=async_op
        )
    raise ValueError(op)


def _views(ctx: Ctx, backend: str, inp: Any, out: Any) -> tuple[Any, Any]:
    """The buffers ``backend`` uses: the given ones, or same-size views of its symmetric arena
    (filled with the input's values)."""
    arena = ctx.arenas.get(backend)
    if arena is None:
        return inp, out
    a_in, a_out = arena
    need_in, need_out = inp.numel() * inp.element_size(), out.numel() * out.element_size()
    if need_in > a_in.numel() or need_out > a_out.numel():
        raise ValueError(f"{backend}: symmetric arena smaller than {need_in} / {need_out} bytes")
    v_in = a_in[:need_in].view(inp.dtype).view(inp.shape)
    v_out = a_out[:need_out].view(out.dtype).view(out.shape)
    v_in.copy_(inp)
    return v_in, v_out


def _time_iters(ctx: Ctx, fn: Any, warmup: int, iters: int) -> list[float]:
    """Seconds per call: CUDA events around each call (per-call wall clock on CPU)."""
    import torch

    for _ in range(warmup):
        fn()
    if ctx.cuda:
        marks = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(iters)
        ]
        for start, end in marks:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(ctx.dev)
        return [start.elapsed_time(end) / 1e3 for start, end in marks]
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _iters(nbytes: int) -> tuple[int, int]:
    if nbytes <= MIB:
        return 3, 20
    if nbytes <= 32 * MIB:
        return 2, 10
    return 1, 5


# ---------------------------------------------------------------------- setup
def _setup(ctx: Ctx, deadline: float) -> dict[str, Any]:
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
            j: torch.cuda.can_device_access_peer(ctx.rank, j)
            for j in range(torch.cuda.device_count())
            if j != ctx.rank
        }
        try:
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
            info["torch_nccl_config_fields"] = _err(err)
    # Both kinds of group in one process: one small collective on each.
    checks: dict[str, Any] = {}
    x = torch.full((4,), float(ctx.rank + 1), device=ctx.dev)
    ctx.progress("setup", "nccl")
    try:
        dist.all_reduce(x, group=ctx.nccl)
        checks["nccl_all_reduce"] = bool(torch.all(x == ctx.n * (ctx.n + 1) / 2))
    except Exception as err:
        checks["nccl_all_reduce"] = _err(err)
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
            checks[f"{name}_all_gather"] = _err(err)
        # Which path each peer takes and why (fs_staged: the staging rings on one host).
        info[f"{name}_paths"] = [
            {k: row[k] for k in ("peer", "path", "cuda")} for row in ctx.groups[name].paths()
        ]
    info["group_checks"] = checks
    if "nccl_ce" in ctx.phase["backends"]:
        ctx.progress("setup", "nccl_ce")
        info["nccl_ce"] = _setup_symmetric(ctx)
        if not all(_allgather(ctx, "nccl_ce" in ctx.arenas)):  # every rank runs it, or none
            ctx.groups.pop("nccl_ce", None)
            ctx.arenas.pop("nccl_ce", None)
    if ctx.rank == 0:
        info["freescale_comm"] = _freescale_info()
        info["topology"] = _run_text(["nvidia-smi", "topo", "-m"]) if ctx.cuda else "cpu"
        if ctx.cuda:
            info["nvlink_status"] = _run_text(["nvidia-smi", "nvlink", "-s"])[:3000]
    per_rank = _allgather(ctx, info)
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
        tried.append(f"symmetric memory: {_err(err)}")
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
        tried.append(f"mem pool: {_err(err)}")
    ctx.groups.pop("nccl_ce", None)
    return "failed, nccl_ce dropped: " + " || ".join(tried)


def _freescale_info() -> Any:
    try:
        from freescale_comm.info import ucx_transports

        return {"ucx_transports": ucx_transports()}
    except Exception as err:
        return _err(err)


def _run_text(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
        return (done.stdout + done.stderr).strip()
    except Exception as err:
        return _err(err)


# ---------------------------------------------------------------------- correctness
def _values(shape: tuple[int, ...], dtype: Any, seed: int, dev: Any) -> Any:
    import torch

    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        data = torch.randn(shape, generator=gen) * 100
    else:
        data = torch.randint(-(2**40), 2**40, shape, generator=gen)
    return data.to(dtype).to(dev)


def _check_case(ctx: Ctx, name: str, fs: Any, dtype: Any, case: int) -> dict[str, Any]:
    """Runs one collective on NCCL and on freescale with the same inputs; compares both results
    with each other and with the expected values."""
    import torch

    n, dev = ctx.n, ctx.dev
    gen = torch.Generator().manual_seed(case)
    rows = int(torch.randint(1, 9, (1,), generator=gen))

    def piece(src: int, dst: int, k: int) -> Any:
        return _values((k, 3), dtype, 100_000 * case + 1000 * src + dst, dev)

    def empty(k: int) -> Any:
        return torch.full((k, 3), -7, dtype=dtype, device=dev)

    splits = [[(i + 2 * j + case) % 4 for j in range(n)] for i in range(n)]  # has zeros
    results: dict[str, Any] = {}
    for which, group in (("nccl", ctx.nccl), ("fs", fs)):
        try:
            results[which] = _run_case(ctx, name, group, rows, piece, empty, splits)
        except Exception as err:
            if which == "fs":
                raise
            results[which] = _err(err)
    fs_out, want = results["fs"]
    if isinstance(results["nccl"], str):
        return {
            "equal_expected": bool(torch.equal(fs_out, want)),
            "equal_nccl": None,
            "nccl_error": results["nccl"],
        }
    return {
        "equal_nccl": bool(torch.equal(fs_out, results["nccl"][0])),
        "equal_expected": bool(torch.equal(fs_out, want)),
        "nccl_equal_expected": bool(torch.equal(results["nccl"][0], want)),
    }


def _run_case(
    ctx: Ctx, name: str, group: Any, rows: int, piece: Any, empty: Any, splits: list[list[int]]
) -> tuple[Any, Any]:
    import torch
    import torch.distributed as dist

    n, rank = ctx.n, ctx.rank
    if name == "all_gather_into_tensor":
        out = empty(n * rows)
        dist.all_gather_into_tensor(out, piece(rank, rank, rows), group=group)
        want = torch.cat([piece(j, j, rows) for j in range(n)])
    elif name == "all_gather":
        outs = [empty(rows) for _ in range(n)]
        dist.all_gather(outs, piece(rank, rank, rows), group=group)
        out, want = torch.cat(outs), torch.cat([piece(j, j, rows) for j in range(n)])
    elif name == "all_gather_into_tensor_coalesced":
        import torch.distributed._functional_collectives as funcol

        ins = [piece(rank, rank, rows), piece(rank, rank + n, rows + 1)]
        got = funcol.all_gather_into_tensor_coalesced(ins, group)
        out = torch.cat([funcol.wait_tensor(t) for t in got])
        want = torch.cat(
            [
                torch.cat([piece(j, j, rows) for j in range(n)]),
                torch.cat([piece(j, j + n, rows + 1) for j in range(n)]),
            ]
        )
    elif name in ("all_to_all_single_even", "all_to_all_single_async"):
        send = torch.cat([piece(rank, j, rows) for j in range(n)])
        out = empty(n * rows)
        work = dist.all_to_all_single(out, send, group=group, async_op=name.endswith("async"))
        if work is not None:
            work.wait()
        want = torch.cat([piece(j, rank, rows) for j in range(n)])
    elif name == "all_to_all_single_uneven":
        send = torch.cat([piece(rank, j, splits[rank][j]) for j in range(n)])
        out = empty(sum(splits[j][rank] for j in range(n)))
        dist.all_to_all_single(
            out, send, [splits[j][rank] for j in range(n)], splits[rank], group=group
        )
        want = torch.cat([piece(j, rank, splits[j][rank]) for j in range(n)])
    elif name == "all_to_all":
        ins = [piece(rank, j, splits[rank][j]) for j in range(n)]
        outs = [empty(splits[j][rank]) for j in range(n)]
        dist.all_to_all(outs, ins, group=group)
        out = torch.cat(outs)
        want = torch.cat([piece(j, rank, splits[j][rank]) for j in range(n)])
    else:
        raise ValueError(name)
    return out.cpu(), want.cpu()


CHECKS = (
    "all_gather_into_tensor",
    "all_gather",
    "all_gather_into_tensor_coalesced",
    "all_to_all_single_even",
    "all_to_all_single_uneven",
    "all_to_all",
    "all_to_all_single_async",
)


def _correctness(ctx: Ctx, deadline: float) -> dict[str, Any]:
    import torch

    rows = []
    case = 0
    for path in (b for b in FREESCALE if b in ctx.backends()):
        ctx.progress("correctness", path)
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            checks = {}
            for name in CHECKS:
                case += 1
                _barrier(ctx)
                try:
                    local: Any = _check_case(ctx, name, ctx.groups[path], dtype, case)
                except Exception as err:
                    local = {"error": _err(err)}
                per_rank = _allgather(ctx, local)
                ok = all(
                    "error" not in r and r["equal_expected"] and r["equal_nccl"] is not False
                    for r in per_rank
                )
                no_ref = any(r.get("equal_nccl") is None for r in per_rank)
                checks[name] = (
                    {"ok": True, "nccl_reference": not no_ref}
                    if ok and not no_ref
                    else {"ok": ok, "nccl_reference": not no_ref, "ranks": per_rank}
                )
            rows.append(
                {
                    "path": path,
                    "dtype": str(dtype).removeprefix("torch."),
                    "checks": checks,
                    "all_ok": all(c["ok"] for c in checks.values()),
                }
            )
            if time.time() > deadline:
                rows.append({"skipped": "time budget"})
                return {"rows": rows, "all_ok": False}
    return {"rows": rows, "all_ok": all(r.get("all_ok", False) for r in rows)}


# ---------------------------------------------------------------------- kernels (profiler)
def _kernels(ctx: Ctx, deadline: float) -> dict[str, Any]:
    import torch

    if not ctx.cuda:
        return {"skipped": "CPU dry run"}
    from torch.profiler import ProfilerActivity, profile

    numel = MIB  # 4 MiB of float32
    base_in = _pattern(ctx.rank, 0, numel, ctx.dev)
    base_out = torch.empty(numel, device=ctx.dev)
    result = {}
    for backend in ctx.backends():
        group = ctx.groups[backend]
        ctx.progress("kernels", backend)
        _barrier(ctx)
        try:
            a_in, a_out = _views(ctx, backend, base_in, base_out)
            inputs = {"all_to_all_single": a_in, "all_gather_into_tensor": a_in[: numel // ctx.n]}
            local: Any = {}
            for op, op_in in inputs.items():
                _collective(op, group, a_out, op_in)
                torch.cuda.synchronize(ctx.dev)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(2):
                        _collective(op, group, a_out, op_in)
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
            local = {"error": _err(err)}
        result[backend] = _allgather(ctx, local)
        if time.time() > deadline:
            result["skipped"] = "time budget"
            break
    return result


# ---------------------------------------------------------------------- sweep
def _sweep(ctx: Ctx, deadline: float) -> dict[str, Any]:
    import torch

    args, n, rank = ctx.args, ctx.n, ctx.rank
    sizes = _sizes(args.min_bytes, args.max_bytes, args.factor)
    rows: list[dict[str, Any]] = []
    skipped = None
    last_cost = 0.0
    for nbytes in sizes:
        if not _time_ok(ctx, 2.5 * last_cost + 1.0, deadline):
            skipped = f"sizes from {fmt_size(nbytes)} on: time budget"
            break
        t_size = time.time()
        for op in OPS:
            count, in_n, out_n, splits = _geometry(op, nbytes, n, rank)
            base_in = _pattern(rank, 0, in_n, ctx.dev)
            base_out = torch.empty(out_n, device=ctx.dev)
            warmup, iters = _iters(nbytes)
            for backend in ctx.backends():
                group = ctx.groups[backend]
                ctx.progress("sweep", backend)
                _barrier(ctx)
                try:
                    inp, out = _views(ctx, backend, base_in, base_out)
                    out.fill_(-1)

                    def call(
                        group: Any = group,
                        out: Any = out,
                        inp: Any = inp,
                        op: str = op,
                        splits: Any = splits,
                    ) -> None:
                        _collective(op, group, out, inp, splits)

                    times = _time_iters(ctx, call, warmup, iters)
                    local: Any = {
                        "t": statistics.median(times),
                        "t_min": min(times),
                        "ok": _check(op, out, n, rank, count, ctx.dev),
                    }
                except Exception as err:
                    local = {"error": _err(err)}
                per_rank = _allgather(ctx, local)
                row: dict[str, Any] = {"op": op, "bytes": count * 4, "backend": backend}
                errors = [r["error"] for r in per_rank if "error" in r]
                if errors:
                    row["error"] = errors[0]
                else:
                    t = max(r["t"] for r in per_rank)  # the slowest rank's median
                    algbw = count * 4 / t / 1e9
                    row.update(
                        time_us=round(t * 1e6, 2),
                        time_min_us=round(min(r["t_min"] for r in per_rank) * 1e6, 2),
                        algbw_gbps=float(f"{algbw:.5g}"),
                        busbw_gbps=float(f"{algbw * (n - 1) / n:.5g}"),
                        correct=all(r["ok"] for r in per_rank),
                        iters=iters,
                    )
                rows.append(row)
            del base_in, base_out
        last_cost = time.time() - t_size
        if ctx.rank == 0:
            print(f"[sweep] {fmt_size(nbytes)} done in {last_cost:.1f} s", flush=True)
    return {
        "world_size": n,
        "dtype": "float32",
        "size_convention": "nccl-tests: all_gather = output bytes, all_to_all = bytes sent "
        "per rank (uneven: nominal)",
        "busbw": "algbw * (n-1)/n",
        "time": "median over iterations, slowest rank",
        "uneven_counts_formula": "c[src][dst] = count * w / sum(w), w = 1 + (src+2dst)%(n+1)",
        "rows": rows,
        "skipped": skipped,
    }


def _check(op: str, out: Any, n: int, rank: int, count: int, dev: Any) -> bool:
    import torch

    if op == "all_gather_into_tensor":
        per = count // n
        return all(
            torch.equal(out[j * per : (j + 1) * per], _pattern(j, 0, per, dev)) for j in range(n)
        )
    if op == "all_to_all_single":
        per = count // n
        return all(
            torch.equal(out[j * per : (j + 1) * per], _pattern(j, rank * per, per, dev))
            for j in range(n)
        )
    c = _uneven(count, n)
    pos, ok = 0, True
    for src in range(n):
        k, offset = c[src][rank], sum(c[src][:rank])
        ok = ok and torch.equal(out[pos : pos + k], _pattern(src, offset, k, dev))
        pos += k
    return ok and pos == out.numel()


# ---------------------------------------------------------------------- overlap
def _compute_kernels(ctx: Ctx) -> dict[str, Any]:
    """name -> a zero-argument compute call, or an error string."""
    import torch

    kinds: dict[str, Any] = {}
    dim = 8192 if ctx.cuda else 192
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    a = torch.randn(dim, dim, device=ctx.dev, dtype=dtype)
    b = torch.randn(dim, dim, device=ctx.dev, dtype=dtype)
    c = torch.empty(dim, dim, device=ctx.dev, dtype=dtype)
    kinds[f"matmul_{dim}"] = lambda: torch.mm(a, b, out=c)
    if not ctx.cuda or ctx.args.no_attention:
        kinds["jagged_attention"] = "skipped: CPU dry run" if not ctx.cuda else "skipped"
        return kinds
    try:
        gen = torch.Generator().manual_seed(5)
        lengths = (torch.rand(32, generator=gen) ** 2 * 3968 + 128).to(torch.int64)
        heads, head_dim = 16, 128
        total = int(lengths.sum())
        q, k, v = (
            torch.randn(total, heads, head_dim, device=ctx.dev, dtype=torch.bfloat16)
            for _ in range(3)
        )
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = lengths.cumsum(0)
        cu = cu.to(ctx.dev)
        longest = int(lengths.max())

        def attention() -> Any:
            return torch.ops.aten._flash_attention_forward(
                q, k, v, cu, cu, longest, longest, 0.0, True, False
            )

        attention()
        torch.cuda.synchronize(ctx.dev)
        kinds["jagged_attention"] = attention
        ctx.notes["jagged_attention"] = {
            "sequences": len(lengths),
            "tokens": total,
            "max_len": longest,
            "heads": heads,
            "head_dim": head_dim,
            "causal": True,
        }
    except Exception as err:
        kinds["jagged_attention"] = f"error: {_err(err)}"
    return kinds


def _graphed(ctx: Ctx, compute: Any, count: int) -> tuple[Any, bool, str | None]:
    """One call that runs ``compute`` ``count`` times: a CUDA graph replay where capture works
    (so the window does not depend on this process's Python threads), else a plain loop."""
    import torch

    def loop() -> None:
        for _ in range(count):
            compute()

    if not ctx.cuda:
        return loop, False, None
    try:
        side = torch.cuda.Stream(device=ctx.dev)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            compute()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            loop()
        graph.replay()
        torch.cuda.synchronize(ctx.dev)
        return graph.replay, True, None
    except Exception as err:
        torch.cuda.synchronize(ctx.dev)
        return loop, False, _err(err)


def _window(ctx: Ctx, run: Any, preroll_cycles: int) -> float:
    """Milliseconds of one compute window on the current stream."""
    import torch

    if not ctx.cuda:
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e3
    # A sleep first, outside the window, so that the launches below are queued before it starts.
    torch.cuda._sleep(preroll_cycles)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _window_with_traffic(
    ctx: Ctx, run: Any, preroll: int, coll: Any, count: int, side: Any
) -> tuple[float, dict[str, Any]]:
    """A compute window while another thread runs ``count`` collectives back to back on a side
    stream of this process (the thread's own current stream, so nothing orders them after the
    compute)."""
    import torch

    box: dict[str, Any] = {}

    def traffic() -> None:
        try:
            if ctx.cuda:
                torch.cuda.set_device(ctx.dev)
            t0 = time.perf_counter()
            with torch.cuda.stream(side) if ctx.cuda else nullcontext():
                for _ in range(count):
                    coll()
            if ctx.cuda:
                side.synchronize()
            box["comm_s"] = time.perf_counter() - t0
        except Exception as err:
            box["error"] = _err(err)

    worker = threading.Thread(target=traffic, name="bench-traffic", daemon=True)
    t0 = time.perf_counter()
    worker.start()
    ms = _window(ctx, run, preroll)
    box["window_wall_s"] = time.perf_counter() - t0
    worker.join(timeout=120)
    if worker.is_alive():
        box["error"] = "traffic thread still running after 120 s"
    return ms, box


def _overlap(ctx: Ctx, deadline: float) -> dict[str, Any]:
    import torch

    args, n, rank = ctx.args, ctx.n, ctx.rank
    result: dict[str, Any] = {"combos": [], "notes": ctx.notes}
    kinds = _compute_kernels(ctx)
    side = torch.cuda.Stream(device=ctx.dev) if ctx.cuda else None
    preroll_cycles = int(args.preroll_ms * 1.98e6)
    preroll_ms = 0.0
    if ctx.cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(2):
            start.record()
            torch.cuda._sleep(preroll_cycles)
            end.record()
            end.synchronize()
        preroll_ms = start.elapsed_time(end)
    result["preroll_ms"] = preroll_ms
    runs: dict[str, Any] = {}
    for kind, compute in kinds.items():
        if isinstance(compute, str):
            result[f"{kind}_status"] = compute
            continue
        try:
            for _ in range(3):
                compute()
            per = statistics.median(_time_iters(ctx, compute, 1, 5)) * 1e3
            iters = max(_allgather(ctx, max(2, min(2000, math.ceil(args.window_ms / per)))))
            run, graphed, why = _graphed(ctx, compute, iters)
            ms = statistics.median(_window(ctx, run, preroll_cycles) for _ in range(3))
            window_ms = max(_allgather(ctx, ms))
            runs[kind] = (run, window_ms)
            result[f"{kind}_status"] = {
                "per_call_ms": round(per, 4),
                "calls_per_window": iters,
                "window_ms": round(window_ms, 3),
                "cuda_graph": graphed,
                "graph_error": why,
            }
        except Exception as err:
            result[f"{kind}_status"] = f"error: {_err(err)}"
    backends = ctx.backends()
    for kind, (run, window_ms) in runs.items():
        for op in OVERLAP_OPS:
            for nbytes in args.overlap_sizes:
                est = args.rounds * (len(backends) + 1) * (window_ms + preroll_ms) * 3e-3 + 5
                if not _time_ok(ctx, est, deadline):
                    result["combos"].append(
                        {"compute": kind, "op": op, "bytes": nbytes, "skipped": "time budget"}
                    )
                    continue
                try:
                    combo = _overlap_combo(
                        ctx, kind, run, window_ms, preroll_ms, preroll_cycles, op, nbytes, side
                    )
                except Exception as err:  # an error here is the same on every rank
                    combo = {"compute": kind, "op": op, "bytes": nbytes, "error": _err(err)}
                result["combos"].append(combo)
                if rank == 0:
                    print(
                        f"[overlap] {kind} {op} {fmt_size(nbytes)}: "
                        f"{combo.get('slowdown_pct_mean', combo.get('error'))}",
                        flush=True,
                    )
    result["world_size"] = n
    return result


def _overlap_combo(
    ctx: Ctx,
    kind: str,
    run: Any,
    window_ms: float,
    preroll_ms: float,
    preroll_cycles: int,
    op: str,
    nbytes: int,
    side: Any,
) -> dict[str, Any]:
    import torch

    n, rank = ctx.n, ctx.rank
    count, in_n, out_n, splits = _geometry(op, nbytes, n, rank)
    base_in = _pattern(rank, 0, in_n, ctx.dev)
    base_out = torch.empty(out_n, device=ctx.dev)
    calls: dict[str, Any] = {}
    counts: dict[str, int] = {}
    errors: dict[str, str] = {}
    for backend in ctx.backends():
        group = ctx.groups[backend]
        ctx.progress("overlap", backend)
        _barrier(ctx)
        try:
            inp, out = _views(ctx, backend, base_in, base_out)

            def call(group: Any = group, out: Any = out, inp: Any = inp) -> None:
                _collective(op, group, out, inp, splits)

            local: Any = statistics.median(_time_iters(ctx, call, 1, 3))
            calls[backend] = call
        except Exception as err:
            local = {"error": _err(err)}
        per_rank = _allgather(ctx, local)
        bad = [r for r in per_rank if isinstance(r, dict)]
        if bad:
            errors[backend] = bad[0]["error"]
            calls.pop(backend, None)
            continue
        once_ms = max(per_rank) * 1e3
        counts[backend] = max(2, min(5000, math.ceil(1.3 * (window_ms + preroll_ms) / once_ms) + 1))
    modes = ["alone", *calls]
    samples: dict[str, list[float]] = {m: [] for m in modes}
    comm_s: dict[str, list[float]] = {m: [] for m in calls}
    for round_index in range(ctx.args.rounds):
        shift = round_index % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            if mode not in calls and mode != "alone":
                continue  # failed in an earlier round
            _sync(ctx)
            _barrier(ctx)
            if mode == "alone":
                samples[mode].append(_window(ctx, run, preroll_cycles))
                continue
            ctx.progress("overlap", mode)
            ms, box = _window_with_traffic(
                ctx, run, preroll_cycles, calls[mode], counts[mode], side
            )
            failed = [e for e in _allgather(ctx, box.get("error")) if e]
            if failed:  # every rank drops the backend from the later rounds
                errors[mode] = failed[0]
                calls.pop(mode)
                continue
            samples[mode].append(ms)
            comm_s[mode].append(box["comm_s"])
    samples = {m: v for m, v in samples.items() if v and (m == "alone" or m in calls)}
    comm_s = {m: v for m, v in comm_s.items() if m in calls}
    local = {
        "median_ms": {m: statistics.median(v) for m, v in samples.items()},
        "samples_ms": {m: [round(x, 4) for x in v] for m, v in samples.items()},
        "comm_s": {m: statistics.median(v) for m, v in comm_s.items()},
    }
    per_rank = _allgather(ctx, local)
    slowdown: dict[str, list[float]] = {}
    gbps: dict[str, list[float]] = {}
    coverage: dict[str, list[float]] = {}
    for backend in calls:
        slowdown[backend] = [
            round(100 * (r["median_ms"][backend] / r["median_ms"]["alone"] - 1), 3)
            for r in per_rank
        ]
        gbps[backend] = [
            round(counts[backend] * count * 4 / r["comm_s"][backend] / 1e9, 3) for r in per_rank
        ]
        coverage[backend] = [
            round(r["comm_s"][backend] * 1e3 / (r["median_ms"][backend] + preroll_ms), 3)
            for r in per_rank
        ]
    mean = {b: round(statistics.fmean(v), 3) for b, v in slowdown.items()}
    combo = {
        "compute": kind,
        "op": op,
        "bytes": count * 4,
        "collectives_per_window": counts,
        "alone_ms": [round(r["median_ms"]["alone"], 4) for r in per_rank],
        "slowdown_pct": slowdown,
        "slowdown_pct_mean": mean,
        "comm_gbps_during_window": gbps,
        "comm_time_over_window": coverage,
        "errors": errors,
        "per_rank": per_rank,
    }
    nccl_ref = [mean[b] for b in mean if b.startswith("nccl")]
    combo["target"] = {
        b: {
            "below_2pct": mean[b] < TARGET_PCT,
            "gap_to_nccl_points": round(min(nccl_ref) - mean[b], 3) if nccl_ref else None,
            "met": mean[b] < TARGET_PCT
            and bool(nccl_ref)
            and min(nccl_ref) - mean[b] >= TARGET_GAP,
        }
        for b in mean
        if b in FREESCALE
    }
    return combo


# ---------------------------------------------------------------------- embed (parent side)
def _embed(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """freescale_embed's own benchmark (it starts its ranks itself), once per backend, where its
    API can run it on the GPUs over a chosen backend; otherwise says why it was not run."""
    import dataclasses

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
            results[backend] = {"config": kwargs, "error": _err(err)}
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


SECTIONS = {
    "setup": _setup,
    "correctness": _correctness,
    "kernels": _kernels,
    "sweep": _sweep,
    "overlap": _overlap,
}


def _rank_main(
    rank: int,
    port: int,
    args: argparse.Namespace,
    phase: dict[str, Any],
    deadline: float,
    queue: Any,
) -> None:
    os.environ.update(SAFE_ENV)
    os.environ.update(phase["env"])
    for path in reversed(SRC_DIRS):
        if path.is_dir() and str(path) not in sys.path:
            sys.path.insert(0, str(path))
    sys.setswitchinterval(0.0005)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch
    import torch.distributed as dist

    def send(kind: str, *payload: Any) -> None:
        # Plain JSON data only: the queue pickles in a feeder thread, where an error is lost.
        clean = json.loads(json.dumps(list(payload), default=str))
        queue.put((kind, phase["name"], rank, *clean))

    cuda = not args.dry_run
    if cuda:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        # Every backend is called from a stream of its own, not the legacy default stream:
        # torch runs a synchronous NCCL collective on the caller's stream, and NCCL 2.28.9's
        # copy-engine path hands that stream to cudaMemcpyBatchAsync, which rejects the legacy
        # one ("Cuda failure 'invalid argument'", ce_coll.cc:341, in the first two-GPU runs;
        # NCCL 2.30's ncclCeLaunchBatchOps falls back to per-copy cudaMemcpyAsync there).
        torch.cuda.set_stream(torch.cuda.Stream(dev))
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(1)
    ctx = Ctx(rank=rank, n=args.nprocs, dev=dev, cuda=cuda, args=args, phase=phase, send=send)
    timeout = timedelta(seconds=args.group_timeout)
    try:
        import freescale_comm
        from freescale_comm import FreescaleOptions

        freescale_comm.register()
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group(
            "freescale",
            store=store,
            rank=rank,
            world_size=args.nprocs,
            timeout=timeout,
            pg_options=FreescaleOptions(cuda_path="direct"),
        )
        ctx.groups["fs_direct"] = dist.group.WORLD
        ctx.groups["fs_staged"] = dist.new_group(
            backend="freescale", timeout=timeout, pg_options=FreescaleOptions(cuda_path="staged")
        )
        ctx.gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
        ctx.nccl = dist.new_group(backend="gloo" if args.dry_run else "nccl", timeout=timeout)
        for backend in phase["backends"]:
            if backend.startswith("nccl") and backend != "nccl_ce":  # nccl_ce: once set up
                ctx.groups[backend] = ctx.nccl
    except Exception as err:
        send("section", "init", {"error": _err(err)}, 0.0)
        send("done")
        return
    try:
        sections = [s for s in phase["sections"] if s in args.sections]
        for index, name in enumerate(sections):
            reserve = sum(SECTION_MIN[s] for s in sections[index + 1 :])
            end = min(deadline - reserve, time.time() + SECTION_CAP[name] * args.cap_scale)
            t0 = time.time()
            if not _time_ok(ctx, SECTION_MIN[name], end):
                payload: Any = {"skipped": "time budget"}
            else:
                try:
                    payload = SECTIONS[name](ctx, end)
                except Exception as err:
                    payload = {"error": _err(err)}
            seconds = round(time.time() - t0, 1)
            if rank == 0 or (isinstance(payload, dict) and "error" in payload):
                send("section", name, payload, seconds)
            if rank == 0:
                print(f"[{phase['name']}] {name} done in {seconds} s", flush=True)
    finally:
        send("done")
        try:
            dist.destroy_process_group()
        except Exception as err:
            print(f"rank {rank}: destroy_process_group: {err}", flush=True)


# ====================================================================== parent side
def _run_phase(
    args: argparse.Namespace,
    phase: dict[str, Any],
    deadline: float,
    hard_deadline: float,
    report: dict[str, Any],
) -> None:
    import torch.distributed as dist

    record: dict[str, Any] = {
        "env": phase["env"],
        "backends": phase["backends"],
        "sections": {},
        "rank_errors": [],
    }
    report["phases"][phase["name"]] = record
    spawn = multiprocessing.get_context("spawn")
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    queue = spawn.Queue()
    saved = {k: os.environ.get(k) for k in phase["env"]}
    os.environ.update(phase["env"])  # the children also set it first thing
    procs = [
        spawn.Process(
            target=_rank_main, args=(r, store.port, args, phase, deadline, queue), daemon=False
        )
        for r in range(args.nprocs)
    ]
    t0 = time.time()
    try:
        for proc in procs:
            proc.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    done: set[int] = set()
    give_up_at = hard_deadline
    while len(done) < args.nprocs:
        left = min(hard_deadline, give_up_at) - time.time()
        if left <= 0:
            record["rank_errors"].append("phase stopped at its deadline")
            break
        try:
            message = queue.get(timeout=min(left, 5.0))
        except queue_lib.Empty:
            dead = [p.exitcode for p in procs if not p.is_alive()]
            if dead and any(code not in (0, None) for code in dead):
                record["rank_errors"].append(f"a rank exited early: exit codes {dead}")
                break
            continue
        kind, _, rank = message[:3]
        if kind == "done":
            done.add(rank)
        elif kind == "progress":
            record["last_progress"] = list(message[3:])
        elif kind == "section":
            name, payload, seconds = message[3:]
            if name == "init":  # the other ranks would wait for it in vain: give them 30 s
                give_up_at = min(give_up_at, time.time() + 30)
            if rank == 0:
                record["sections"][name] = {"result": payload, "seconds": seconds}
            else:
                record["rank_errors"].append({"rank": rank, "section": name, "result": payload})
            _write_json(args.out, report)
    for proc in procs:
        proc.join(timeout=max(1.0, min(20.0, hard_deadline + 10 - time.time())))
    for proc in procs:
        if proc.is_alive():
            record["rank_errors"].append(f"rank process {proc.pid} killed after the phase")
            proc.kill()
            proc.join(5)
    record["exit_codes"] = [proc.exitcode for proc in procs]
    record["completed"] = len(done) == args.nprocs and all(c == 0 for c in record["exit_codes"])
    record["seconds"] = round(time.time() - t0, 1)
    _write_json(args.out, report)


def _retry_phase(phase: dict[str, Any], record: dict[str, Any]) -> dict[str, Any] | None:
    """After a phase whose processes died or hung: the parts it did not finish, once more,
    without the backend that was running when it stopped."""
    if record.get("completed", True) or phase.get("retry"):
        return None
    section, suspect = (record.get("last_progress") or [None, None])[:2]
    finished = [
        s
        for s, v in record["sections"].items()
        if s != "setup"
        and isinstance(v.get("result"), dict)
        and "error" not in v["result"]
        and "skipped" not in v["result"]
    ]
    sections = [s for s in phase["sections"] if s == "setup" or s not in finished]
    backends = [b for b in phase["backends"] if b != suspect]
    if not backends or sections == ["setup"]:
        return None
    record["retried_without"] = {"backend": suspect, "stopped_in": section}
    return {
        **phase,
        "name": f"{phase['name']}_retry",
        "backends": backends,
        "sections": sections,
        "retry": True,
        "dropped": suspect,
    }


def _write_json(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (JSON_NAME + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(out / JSON_NAME)


def _section(report: dict[str, Any], phase: str, name: str) -> Any:
    return report["phases"].get(phase, {}).get("sections", {}).get(name, {}).get("result")


def _main_section(report: dict[str, Any], name: str) -> Any:
    """A part of the main phase: its own result, or its retry's where it has none."""
    first = _section(report, "main", name)
    if isinstance(first, dict) and not ("error" in first or "skipped" in first):
        return first
    retry = _section(report, "main_retry", name)
    return retry if retry is not None else first


def _sweep_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for phase in report["phases"]:
        result = _section(report, phase, "sweep")
        if isinstance(result, dict):
            rows.extend(result.get("rows", []))
    return rows


def _overlap_combos(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    combos = []
    for phase in report["phases"]:
        result = _section(report, phase, "overlap")
        if isinstance(result, dict):
            combos.extend((phase, c) for c in result.get("combos", []))
    return combos


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    corr = _main_section(report, "correctness")
    if isinstance(corr, dict) and "rows" in corr:
        summary["correctness_all_ok"] = corr["all_ok"]
        summary["correctness_failures"] = [
            f"{r['path']} {r['dtype']} {k}"
            for r in corr["rows"]
            if "checks" in r
            for k, c in r["checks"].items()
            if not c["ok"]
        ]
    rows = _sweep_rows(report)
    summary["sweep_incorrect"] = [
        f"{r['backend']} {r['op']} {fmt_size(r['bytes'])}"
        for r in rows
        if r.get("correct") is False
    ]
    summary["sweep_errors"] = len([r for r in rows if "error" in r])
    peak: dict[str, dict[str, float]] = {}
    for r in rows:
        if "busbw_gbps" in r:
            best = peak.setdefault(r["op"], {})
            best[r["backend"]] = max(best.get(r["backend"], 0.0), r["busbw_gbps"])
    summary["peak_busbw_gbps"] = peak
    targets = {}
    for phase, c in _overlap_combos(report):
        for backend, t in c.get("target", {}).items():
            targets[f"{phase}:{c['compute']}:{c['op']}:{fmt_size(c['bytes'])}:{backend}"] = t["met"]
    kern = _main_section(report, "kernels")
    if isinstance(kern, dict):
        summary["kernels_per_collective_rank0"] = {
            backend: {
                op: v.get("kernels_per_op") for op, v in per_rank[0].items() if isinstance(v, dict)
            }
            for backend, per_rank in kern.items()
            if isinstance(per_rank, list) and isinstance(per_rank[0], dict)
        }
        ce = summary["kernels_per_collective_rank0"].get("nccl_ce")
        if ce:
            summary["nccl_ce_copy_engine_engaged"] = {op: k == 0 for op, k in ce.items()}
    summary["overlap_target_met"] = targets
    summary["overlap_target_met_all"] = bool(targets) and all(targets.values())
    return summary


def _table(report: dict[str, Any]) -> str:
    lines = [
        f"== freescale vs NCCL, {report['nprocs']} ranks"
        f"{' (DRY RUN: CPU, Gloo for NCCL)' if report['dry_run'] else ''} =="
    ]
    info = report.get("info", {})
    if isinstance(info, dict):
        lines.append(
            f"torch {info.get('torch')}  NCCL {info.get('nccl')}  UCX {info.get('ucx')}"
            f"  cuda_ipc {info.get('cuda_ipc')}  transports "
            f"{','.join(info.get('ucx_transports', []) or [])[:120]}"
        )
    setup = _main_section(report, "setup")
    if isinstance(setup, dict) and "ranks" in setup:
        r0 = setup["ranks"][0]
        lines.append(
            f"groups in one process ok: {setup['all_groups_ok']}  nccl_ce: "
            f"{str(r0.get('nccl_ce', '-'))[:100]}"
        )
    elif setup is not None:
        lines.append(f"setup: {str(setup)[:300]}")
    corr = _main_section(report, "correctness")
    if isinstance(corr, dict) and "rows" in corr:
        for row in corr["rows"]:
            if "checks" not in row:
                lines.append(f"correct: {row}")
                continue
            bad = [k for k, c in row["checks"].items() if not c["ok"]]
            no_ref = [k for k, c in row["checks"].items() if not c.get("nccl_reference", True)]
            lines.append(
                f"correct {row['path']:<9} {row['dtype']:<9} vs NCCL: "
                f"{'OK' if row['all_ok'] else 'FAIL ' + ','.join(bad)}"
                + (f" (vs expected only, NCCL failed: {','.join(no_ref)})" if no_ref else "")
            )
    elif corr is not None:
        lines.append(f"correctness: {str(corr)[:300]}")
    for phase in report["phases"]:
        kern = _section(report, phase, "kernels")
        if isinstance(kern, dict) and "skipped" not in kern and "error" not in kern:
            parts = []
            for backend, per_rank in kern.items():
                first = per_rank[0] if isinstance(per_rank, list) else per_rank
                if not isinstance(first, dict):
                    continue
                counts = [
                    f"{'a2a' if op.startswith('all_to') else 'ag'} {v.get('kernels_per_op')}"
                    for op, v in first.items()
                    if isinstance(v, dict)
                ]
                parts.append(
                    f"{backend}: {first['error'][:60]}"
                    if "error" in first
                    else f"{backend}: {', '.join(counts)}"
                )
            lines.append(f"[{phase}] CUDA kernels per collective (rank 0): " + "; ".join(parts))
    rows = _sweep_rows(report)
    if rows:
        sizes = sorted({r["bytes"] for r in rows})
        show = [s for s in sizes if s in (8, 64 * KIB, MIB, 16 * MIB, 256 * MIB, GIB)]
        if sizes and sizes[-1] not in show:
            show.append(sizes[-1])
        for op in OPS:
            lines.append(
                f"sweep {op}: time us (< 1 MiB) / busbw GB/s (>= 1 MiB); '!' = wrong result"
            )
            lines.append(f"  {'backend':<16}" + "".join(f"{fmt_size(s):>11}" for s in show))
            backends = list(dict.fromkeys(r["backend"] for r in rows if r["op"] == op))
            for backend in backends:
                cells = []
                for s in show:
                    hit = [
                        r
                        for r in rows
                        if r["op"] == op and r["backend"] == backend and r["bytes"] == s
                    ]
                    if not hit:
                        cells.append("-")
                    elif "error" in hit[0]:
                        cells.append("err")
                    else:
                        r = hit[0]
                        value = f"{r['time_us']:.1f}" if s < MIB else f"{r['busbw_gbps']:.1f}"
                        cells.append(value + ("" if r["correct"] else "!"))
                lines.append(f"  {backend:<16}" + "".join(f"{c:>11}" for c in cells))
    combos = _overlap_combos(report)
    if combos:
        lines.append(
            f"overlap: compute slowdown % (mean of ranks) while each backend moves "
            f"data; target freescale < {TARGET_PCT}% and >= {TARGET_GAP} points "
            f"below NCCL"
        )
        for phase, c in combos:
            head = f"  [{phase}] {c['compute']:<18} {c['op']:<23} {fmt_size(c['bytes']):>8}"
            if "slowdown_pct_mean" not in c:
                lines.append(head + f" {c.get('skipped') or str(c.get('error'))[:80]}")
                continue
            cells = ", ".join(f"{b} {v:+.2f}" for b, v in c["slowdown_pct_mean"].items())
            met = [b for b, t in c.get("target", {}).items() if t["met"]]
            lines.append(
                head
                + f" alone {statistics.fmean(c['alone_ms']):.2f} ms: {cells}"
                + (f"  target met: {','.join(met)}" if c.get("target") else "")
            )
    embed = report.get("embed")
    if embed is not None:
        status = embed.get("status") if isinstance(embed, dict) else embed
        lines.append(
            f"embed: {status} (exposed ms per step, mean of ranks: sync / prioritized;"
            " '=' prioritized bitwise equal to sync)"
        )
        for backend in ("freescale", "nccl"):
            result = embed.get(backend) if isinstance(embed, dict) else None
            if not isinstance(result, dict):
                continue
            points = (result.get("report") or {}).get("points") or []
            cells = [
                f"{p['collision_rate']:.0%} {p['sync']['exposed_ms']:.1f}/"
                f"{p['prioritized']['exposed_ms']:.1f}{'=' if p.get('exact') else '!'}"
                for p in points
            ]
            problem = result.get("error") or result.get("skipped")
            lines.append(f"  {backend:<10} " + (", ".join(cells) or str(problem)[:150]))
    problems = [f"error: {report['error']}"] if report.get("error") else []
    for phase, record in report["phases"].items():
        for name, sec in record.get("sections", {}).items():
            res = sec.get("result")
            if isinstance(res, dict) and (res.get("error") or res.get("skipped")):
                why = res.get("error") or res.get("skipped")
                problems.append(f"{phase}/{name}: {why}"[:160])
        for err in record.get("rank_errors", []):
            problems.append(f"{phase}: {str(err)[:160]}")
        if record.get("skipped"):
            problems.append(f"{phase}: skipped ({record['skipped']})")
    lines.extend(f"! {p}" for p in problems)
    lines.append(f"elapsed {report.get('elapsed_s')} s; JSON {report['json']}")
    return "\n".join(lines)


def _plots(report: dict[str, Any], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as err:
        return [f"no plots: {type(err).__name__}: {err}"]
    written = []
    rows = [r for r in _sweep_rows(report) if "busbw_gbps" in r]
    if rows:
        fig, axes = plt.subplots(2, len(OPS), figsize=(6 * len(OPS), 8), squeeze=False)
        for col, op in enumerate(OPS):
            for backend in dict.fromkeys(r["backend"] for r in rows):
                pts = sorted(
                    (r["bytes"], r["busbw_gbps"], r["time_us"])
                    for r in rows
                    if r["op"] == op and r["backend"] == backend
                )
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                axes[0][col].plot(xs, [p[1] for p in pts], marker=".", label=backend)
                axes[1][col].plot(xs, [p[2] for p in pts], marker=".", label=backend)
            axes[0][col].set_title(op)
            axes[0][col].set_ylabel("busbw GB/s")
            axes[1][col].set_ylabel("time us (median)")
            for row in (0, 1):
                axes[row][col].set_xscale("log", base=2)
                axes[row][col].set_yscale("log")
                axes[row][col].set_xlabel("bytes")
                axes[row][col].grid(True, which="both", alpha=0.3)
            axes[0][col].legend(fontsize=8)
        fig.suptitle(f"freescale vs NCCL, {report['nprocs']} ranks")
        fig.tight_layout()
        fig.savefig(out / "sweep.png", dpi=110)
        plt.close(fig)
        written.append("sweep.png")
    combos = [(p, c) for p, c in _overlap_combos(report) if "slowdown_pct_mean" in c]
    if combos:
        backends = list(dict.fromkeys(b for _, c in combos for b in c["slowdown_pct_mean"]))
        fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(combos)), 5))
        width = 0.8 / max(1, len(backends))
        for i, backend in enumerate(backends):
            xs = [
                j + i * width
                for j, (_, c) in enumerate(combos)
                if backend in c["slowdown_pct_mean"]
            ]
            ys = [
                c["slowdown_pct_mean"][backend]
                for _, c in combos
                if backend in c["slowdown_pct_mean"]
            ]
            ax.bar(xs, ys, width, label=backend)
        ax.axhline(TARGET_PCT, color="k", linestyle="--", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(combos))])
        ax.set_xticklabels(
            [
                f"{c['compute'][:10]}\n{c['op'].replace('_single', '')}\n"
                f"{fmt_size(c['bytes'])}" + ("" if p == "main" else f"\n[{p}]")
                for p, c in combos
            ],
            fontsize=7,
        )
        ax.set_ylabel("compute slowdown % (mean of ranks)")
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "overlap.png", dpi=110)
        plt.close(fig)
        written.append("overlap.png")
    return written


def _parent_info() -> Any:
    try:
        from freescale_comm.info import collect

        return collect()
    except Exception as err:
        return {"error": _err(err)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="multi_gpu_vs_nccl", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "out/multi_gpu"))
    parser.add_argument("--nprocs", type=int, default=2, help="ranks, one per GPU")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for everything")
    parser.add_argument("--min-bytes", type=parse_size, default=8)
    parser.add_argument("--max-bytes", type=parse_size, default=GIB)
    parser.add_argument("--factor", type=int, default=2, help="sweep step (2 = every power)")
    parser.add_argument(
        "--overlap-sizes",
        type=lambda s: [parse_size(x) for x in s.split(",")],
        default=[64 * MIB, 256 * MIB],
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--window-ms", type=float, default=60.0, help="compute window per measurement"
    )
    parser.add_argument(
        "--preroll-ms",
        type=float,
        default=8.0,
        help="GPU sleep queued before each window (outside it)",
    )
    parser.add_argument("--embed-steps", type=int, default=20)
    parser.add_argument("--group-timeout", type=float, default=60.0)
    parser.add_argument(
        "--sections",
        type=lambda s: s.split(","),
        default=list(SECTION_CAP),
        help="comma list of parts to run",
    )
    parser.add_argument(
        "--no-p2p-phase", action="store_true", help="skip the NCCL_P2P_USE_CUDA_MEMCPY=1 phase"
    )
    parser.add_argument("--no-attention", action="store_true")
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU tensors, Gloo standing in for NCCL, tiny sizes"
    )
    args = parser.parse_args(argv)
    t_start = time.time()
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.update(SAFE_ENV)
    for path in reversed(SRC_DIRS):
        if path.is_dir() and str(path) not in sys.path:
            sys.path.insert(0, str(path))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(p) for p in SRC_DIRS if p.is_dir()]
        + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]
    )
    args.cap_scale = 1.0
    if args.dry_run:
        args.max_bytes = min(args.max_bytes, 64 * KIB)
        args.factor = max(args.factor, 4)
        args.overlap_sizes = [64 * KIB]
        args.rounds = min(args.rounds, 2)
        args.window_ms = min(args.window_ms, 20.0)
        args.embed_steps = min(args.embed_steps, 3)
    deadline = t_start + args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "script": "benchmarks/multi_gpu_vs_nccl.py",
        "argv": sys.argv[1:] if argv is None else argv,
        "started_unix": t_start,
        "dry_run": args.dry_run,
        "nprocs": args.nprocs,
        "budget_s": args.budget,
        "safe_env": SAFE_ENV,
        "json": str(args.out / JSON_NAME),
        "nccl_facts": NCCL_FACTS,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "phases": {},
    }
    report["info"] = _parent_info()
    if not args.dry_run:
        try:
            import torch

            report["cuda_device_count"] = torch.cuda.device_count()
            if torch.cuda.device_count() < args.nprocs:
                report["error"] = (
                    f"{args.nprocs} ranks need {args.nprocs} GPUs, {torch.cuda.device_count()} seen"
                )
        except Exception as err:
            report["error"] = _err(err)
    _write_json(args.out, report)
    phases = [p for p in PHASES if not (args.no_p2p_phase and p["name"] != "main")]
    if "error" not in report:
        for index, phase in enumerate(phases):
            left = deadline - time.time()
            if left < PHASE_MIN_S and index > 0:
                report["phases"][phase["name"]] = {"skipped": f"time budget ({left:.0f} s left)"}
                continue
            # The main phase leaves room for the later ones, if it can.
            later = PHASE_MIN_S + 40 if index + 1 < len(phases) else 0
            phase_deadline = deadline - later if left > 2.5 * later else deadline
            _run_phase(args, phase, phase_deadline, phase_deadline + 25, report)
            retry = _retry_phase(phase, report["phases"][phase["name"]])
            if retry is not None and phase_deadline - time.time() > PHASE_MIN_S:
                _run_phase(args, retry, phase_deadline, phase_deadline + 25, report)
            if index == 0 and "embed" in args.sections:
                t0 = time.time()
                end = min(
                    deadline - (PHASE_MIN_S if len(phases) > 1 else 0), t0 + SECTION_CAP["embed"]
                )
                try:
                    report["embed"] = _embed(args, end)
                except Exception as err:
                    report["embed"] = {"status": "error", "error": _err(err)}
                report["embed"]["seconds"] = round(time.time() - t0, 1)
                _write_json(args.out, report)
    report["summary"] = _summary(report)
    report["elapsed_s"] = round(time.time() - t_start, 1)
    _write_json(args.out, report)
    report["plots"] = _plots(report, args.out)
    table = _table(report)
    (args.out / "table.txt").write_text(table + "\n")
    _write_json(args.out, report)
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
