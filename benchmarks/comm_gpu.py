"""GPU checks and measurements of freescale_comm's CUDA paths, in one call.

Two ranks on the one rank launcher (``freescale_comm._local_ranks``), one GPU each where the
machine has two (rank r uses GPU r % device count), else both on GPU 0. In order, each part
reported even if another fails:

1. correctness of the IPC (copy-engine pulls through CUDA IPC, ordered by GPU-side flags),
   direct (device buffers to UCX: cuda_ipc) and staged (the staging rings; chunked D2H, host
   messages, H2D over UCX) paths for every own collective, several dtypes, uneven splits,
   multi-chunk sizes, against the result computed locally; plus stream semantics: inputs
   produced and outputs consumed (and the input overwritten) on the caller's stream right
   around the call, with ~8 ms of matmuls queued before it (the call's CPU time is reported
   beside the time until everything was done), first on new allocations (which the IPC path
   maps in the peer) and then on the same ones, synchronous and asynchronous;
2. the profiler: CUDA kernels launched while the comm path runs (must be 0; memcpys are fine);
3. the staged path's time at 64 and 256 MiB against each of its stages alone on the same bytes,
   both ranks at once as in the collective: D2H of the pieces for peers, their host exchange
   (UCX between pinned host buffers), H2D of the pieces from peers; the direct path and NCCL
   (where two GPUs exist) beside it;
4. overlap, inside rank 0's process: the mean time of a bf16 8192^3 matmul in a loop on the
   default stream, alone, while rank 0's own staged AllToAll / AllGather (and the direct
   AllToAll: DtoD copies on a shared GPU) of 64 and 256 MiB run back to back on a side stream
   (NCCL-style: each ordered after the previous one's ``wait``; enough of them, at their
   back-to-back rate, to outlast the window), and while an SM copy kernel (Triton, 16 programs,
   NCCL-like) moves the same bytes in the same window, paced one slice per matmul; NCCL's own
   collectives too where two GPUs exist. Each window of 48 matmuls with traffic sits between two
   windows without (GPU clocks drift by several percent over seconds) and is compared with their
   mean; medians over rounds; a "control" window with no traffic gives the method's own noise
   (``overlap_rounds.py``, the method ``multi_gpu_vs_nccl.py`` uses too). Controls in rank 1's
   process (another CUDA context, time-sliced with rank 0's on one GPU) separate the costs: the
   PCIe copies of the staged AllToAll's bytes, and its own-piece device-to-device copies (one per
   collective) without the collectives; PCIe copies of the same bytes in rank 0's process too.

Writes ``comm_gpu.json`` under ``--out`` (default ``$OUT`` or ``out/comm_gpu``) after every part
and prints a table last. Run on the GPU machine from the project root:
``python benchmarks/comm_gpu.py --out $OUT``. With ``--mps`` the ranks are clients of an MPS
server the script starts for them (and stops): on one GPU their work then runs at once instead
of time-slicing between two contexts.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from overlap_rounds import alternated_rounds

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the module still imports (lint, docs)
    triton = None

MIB = 1 << 20
PCIE_GBPS = 55.0  # pinned copies each way on the H200 machine (shared/GPU.md)
SM_COPY_PROGRAMS = 16
MATMULS = 48
BACK_TO_BACK = 4  # calls timed back to back to count the collectives of an overlap window
COVER = 1.3  # traffic lasts this many windows: it outlasts the matmuls
STAGED_REPEATS = 15
PARTS = ("correctness", "kernels", "busbw", "latency", "staged_rates", "overlap")
BUSBW_SIZES = [64 * MIB, 128 * MIB, 256 * MIB, 512 * MIB, 1024 * MIB]
BUSBW_REPEATS = 7
LATENCY_SIZES = [8, 4 << 10, 64 << 10, 1 << 20]
# Staging rings with more or larger slots than the default 8 x 4 MiB per direction and pair.
POOL_VARIANTS = {
    "staged_16x4MiB": {"staging_pool_bytes": 128 * MIB},
    "staged_8x8MiB": {"staging_pool_bytes": 128 * MIB, "chunk_bytes": 8 * MIB},
}
LATENCY_CALLS = 200

if triton is not None:

    @triton.jit
    def _sm_copy_kernel(src, dst, n, BLOCK: tl.constexpr):
        # A persistent copy loop on a few programs: SM-driven traffic like NCCL's channels.
        start = tl.program_id(0) * BLOCK
        step = tl.num_programs(0) * BLOCK
        for offset in range(start, n, step):
            index = offset + tl.arange(0, BLOCK)
            mask = index < n
            tl.store(dst + index, tl.load(src + index, mask=mask), mask=mask)


def _sm_copy(dst: Any, src: Any) -> None:
    _sm_copy_kernel[(SM_COPY_PROGRAMS,)](src, dst, src.numel(), BLOCK=4096)


# ----------------------------------------------------------------------------- helpers
def _device() -> Any:
    import torch

    return torch.device("cuda", torch.cuda.current_device())


def _max(value: float, group: Any) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _timed(fn: Any, repeats: int, group: Any) -> float:
    """Median over repeats of the slowest rank's time of ``fn`` (both ranks start together)."""
    import torch
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(_max(time.perf_counter() - start, group))
    return statistics.median(times)


def _piece(src: int, dst: int, rows: int, dtype: Any, dev: Any) -> Any:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(1000 * src + dst)
    return (torch.randn(rows, 3, generator=gen) * 100).to(dtype).to(dev)


# ----------------------------------------------------------------------------- 1. correctness
def _correctness(groups: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    dev = _device()
    rows = []
    for path in ("ipc", "direct", "staged", "staged_ucx"):
        group = groups[path]
        for dtype, scale in (
            (torch.float32, 1),
            (torch.bfloat16, 1),
            (torch.int64, 1),
            (torch.float32, 400_000),
        ):  # the last: 4.6-19 MB, many chunks
            checks = {}
            mine = _piece(rank, rank, 5 * scale, dtype, dev)
            want = torch.cat([_piece(r, r, 5 * scale, dtype, dev) for r in range(n)])
            out = torch.full((n * 5 * scale, 3), -1, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(out, mine, group=group)
            checks["all_gather_into_tensor"] = torch.equal(out, want)
            outs = [torch.empty((5 * scale, 3), dtype=dtype, device=dev) for _ in range(n)]
            dist.all_gather(outs, mine, group=group)
            checks["all_gather"] = torch.equal(torch.cat(outs), want)
            splits = [[((i + 2 * j) % 4) * scale for j in range(n)] for i in range(n)]
            send = torch.cat([_piece(rank, j, splits[rank][j], dtype, dev) for j in range(n)])
            recv = torch.full(
                (sum(splits[j][rank] for j in range(n)), 3), -1, dtype=dtype, device=dev
            )
            dist.all_to_all_single(
                recv, send, [splits[j][rank] for j in range(n)], splits[rank], group=group
            )
            expected = torch.cat([_piece(j, rank, splits[j][rank], dtype, dev) for j in range(n)])
            checks["all_to_all_single_uneven"] = torch.equal(recv, expected)
            ins = [_piece(rank, j, splits[rank][j], dtype, dev) for j in range(n)]
            outs = [torch.empty((splits[j][rank], 3), dtype=dtype, device=dev) for j in range(n)]
            dist.all_to_all(outs, ins, group=group)
            checks["all_to_all"] = all(
                torch.equal(outs[j], _piece(j, rank, splits[j][rank], dtype, dev)) for j in range(n)
            )
            ok = torch.tensor([float(all(checks.values()))])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=groups["gloo"])
            rows.append(
                {
                    "path": path,
                    "dtype": str(dtype),
                    "bytes_per_rank": out.nbytes,
                    "checks": checks,
                    "all_ranks_ok": bool(ok.item()),
                }
            )
    return {"cases": rows, "stream_semantics": _stream_semantics(groups)}


def _stream_semantics(groups: dict[str, Any]) -> list[dict[str, Any]]:
    """Producer and consumer on the caller's stream right around the call."""
    import torch
    import torch.distributed as dist

    from freescale_comm import FreescaleValidationError

    rank, n = dist.get_rank(), dist.get_world_size()
    dev = _device()
    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    numel = 16 * MIB  # 64 MiB of float32
    results = []
    for path in ("ipc", "direct", "staged", "staged_ucx"):
        group = groups[path]
        # The caching allocator's blocks go back to CUDA: x and out below are new allocations,
        # not blocks of a segment the peer has mapped already.
        torch.cuda.empty_cache()
        source = torch.arange(numel, device=dev, dtype=torch.float32) + rank * numel
        want = torch.cat(
            [
                (torch.arange(numel, device=dev, dtype=torch.float32) + r * numel).view(n, -1)[rank]
                for r in range(n)
            ]
        )
        x = torch.zeros(numel, device=dev)
        out = torch.full((numel,), -1.0, device=dev)
        # The first call on new allocations maps them in the peer (``ipc._PeerMaps``), which
        # may wait for the GPU's queued work; a training loop pays it once per allocation.
        for first_use, async_op in ((True, False), (False, False), (False, True)):
            out.fill_(-1.0)
            torch.cuda.synchronize()
            dist.barrier(group=groups["gloo"])
            for _ in range(6):  # ~8 ms of queued work before the input is produced
                torch.mm(big, big)
            x.copy_(source)
            start = time.perf_counter()
            work = dist.all_to_all_single(out, x, group=group, async_op=async_op)
            if async_op:
                work.wait()
            returned = time.perf_counter() - start
            got = out.clone()  # the consumer, on the caller's stream
            x.zero_()  # the caller reuses the input at once (after wait, as with NCCL)
            torch.cuda.synchronize()
            total = time.perf_counter() - start
            results.append(
                {
                    "path": path,
                    "async_op": async_op,
                    "first_use": first_use,
                    "correct": bool(torch.equal(got, want)),
                    "call_ms": 1e3 * returned,
                    "done_ms": 1e3 * total,
                }
            )
        # A mismatch raises at the call, on every rank.
        try:
            dist.all_to_all_single(
                torch.empty(n * (2 + rank), device=dev), torch.empty(n * 2, device=dev), group=group
            )
            raised = "nothing"
        except FreescaleValidationError as err:
            raised = f"FreescaleValidationError: {str(err)[:120]}"
        results.append({"path": path, "bad_input_raises": raised})
    return results


# ----------------------------------------------------------------------------- 2. kernels
def _kernels(groups: dict[str, Any]) -> dict[str, Any]:
    """CUDA kernels the profiler sees while each path's collectives run (rank 0's process)."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    rank = dist.get_rank()
    dev = _device()
    x = torch.randn(8 * MIB, device=dev)  # 32 MiB: several staging chunks
    result = {}
    for path in ("ipc", "direct", "staged", "staged_ucx", "sm_copy_reference"):
        y = torch.empty_like(x)
        torch.cuda.synchronize()
        dist.barrier(group=groups["gloo"])
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            if path == "sm_copy_reference":
                torch.mul(x, 1.0, out=y)  # a kernel: proves the profiler would see one
            else:
                for _ in range(3):
                    dist.all_to_all_single(y, x, group=groups[path])
                    dist.all_gather_into_tensor(y, x[: x.numel() // 2], group=groups[path])
                    work = dist.all_to_all_single(y, x, group=groups[path], async_op=True)
                    work.wait()
            torch.cuda.synchronize()
        kernels, other = [], []
        for evt in prof.events():
            if evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
            (other if evt.name.startswith(("Memcpy", "Memset")) else kernels).append(evt.name)
        if rank == 0:
            result[path] = {
                "kernels": len(kernels),
                "kernel_names": sorted(set(kernels))[:8],
                "memcpys": len(other),
                "memcpy_kinds": sorted(set(other))[:8],
            }
    return result


# ----------------------------------------------------------------------------- busbw
def _busbw(groups: dict[str, Any]) -> list[dict[str, Any]]:
    """nccl-tests' busbw of AllToAll and AllGather per path, 64 MiB to 1 GiB per rank: the
    median over repeats of the slower rank's time of one call (after a warm-up call)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    dev = _device()
    gloo = groups["gloo"]
    rows = []
    for size in BUSBW_SIZES:
        x = torch.randn(size // 4, device=dev)
        y = torch.empty_like(x)
        piece = x[: x.numel() // n]
        ops = {
            "all_to_all": lambda g, x=x, y=y: dist.all_to_all_single(y, x, group=g),
            "all_gather": lambda g, x=piece, y=y: dist.all_gather_into_tensor(y, x, group=g),
        }
        for path in ("ipc", "staged", "direct", "staged_ucx", *POOL_VARIANTS):
            if path == "staged_ucx" and size > 256 * MIB:
                continue  # 4-7 GB/s: the large sizes would take most of the call's time
            if path in POOL_VARIANTS and size not in (64 * MIB, 1024 * MIB):
                continue
            for op, call in ops.items():
                call(groups[path])
                t = _timed(lambda call=call, path=path: call(groups[path]), BUSBW_REPEATS, gloo)
                rows.append(
                    {
                        "path": path,
                        "op": op,
                        "size": size,
                        "ms": 1e3 * t,
                        "algbw_gbps": size / t / 1e9,
                        "busbw_gbps": size * (n - 1) / n / t / 1e9,
                    }
                )
        del x, y, piece, ops
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- latency
def _latency(groups: dict[str, Any]) -> list[dict[str, Any]]:
    """Small CUDA ``all_to_all_single`` per path: the host time of one call (call to return,
    after a barrier and with the GPU idle), one call until its result is on the GPU (call to
    the end of ``torch.cuda.synchronize``), and back-to-back calls then one synchronize
    (per call). Medians; the slower rank. Beside the paths, ``gloo_host``: the caller copies
    its input D2H into page-locked memory, waits for it, runs Gloo's AllToAll on host memory
    and copies the result H2D (a host path through a mature CPU library, and on one GPU the
    least that two contexts' copies around a CPU exchange take), and ``freescale_host``, the
    same over freescale's own CPU path (the ``ipc`` group with host tensors)."""
    import torch
    import torch.distributed as dist

    dev = _device()
    gloo = groups["gloo"]
    rows = []
    for nbytes in LATENCY_SIZES:
        x = torch.ones(max(2, nbytes // 4), device=dev)
        y = torch.empty_like(x)
        for path in ("ipc", "staged", "direct", "staged_ucx", "gloo_host", "freescale_host"):
            if path == "gloo_host":
                call = _through_host(y, x, gloo)
            elif path == "freescale_host":
                call = _through_host(y, x, groups["ipc"])
            else:
                call = functools.partial(dist.all_to_all_single, y, x, group=groups[path])
            for _ in range(10):
                call()
            torch.cuda.synchronize()
            host, done = _single_calls(call, gloo, LATENCY_CALLS // 4)
            per_call = _back_to_back(call, gloo, LATENCY_CALLS // 2)
            rows.append(
                {
                    "path": path,
                    "bytes": nbytes,
                    "host_ms": 1e3 * _max(statistics.median(host), gloo),
                    "done_ms": 1e3 * _max(statistics.median(done), gloo),
                    "back_to_back_ms": 1e3 * _max(statistics.median(per_call), gloo),
                }
            )
    return rows


def _single_calls(
    call: Any, gloo: Any, count: int, after: Callable[[float], None] | None = None
) -> tuple[list[float], list[float]]:
    """``count`` calls, each after a barrier with the GPU idle: per call its host time (call to
    return) and its time until done (to the end of ``torch.cuda.synchronize``); ``after(start)``
    runs after each, with the call's start (``time.perf_counter``)."""
    import torch
    import torch.distributed as dist

    host, done = [], []
    for _ in range(count):
        dist.barrier(group=gloo)
        start = time.perf_counter()
        call()
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        done.append(time.perf_counter() - start)
        if after is not None:
            after(start)
    return host, done


def _back_to_back(call: Any, gloo: Any, calls: int, rounds: int = 3) -> list[float]:
    """Per round, the time per call of ``calls`` back-to-back calls and one synchronize."""
    import torch
    import torch.distributed as dist

    per_call = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        dist.barrier(group=gloo)
        start = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - start) / calls)
    return per_call


def _through_host(y: Any, x: Any, gloo: Any) -> Any:
    """``all_to_all_single(y, x)`` of CUDA tensors as a caller would run it over Gloo: D2H into
    page-locked memory, a CPU wait for that copy, Gloo's AllToAll, H2D (on the current
    stream)."""
    import torch
    import torch.distributed as dist

    host_x = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host_y = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
    copied = torch.cuda.Event()

    def call() -> None:
        host_x.copy_(x, non_blocking=True)
        copied.record()
        copied.synchronize()
        dist.all_to_all_single(host_y, host_x, group=gloo)
        y.copy_(host_y, non_blocking=True)

    return call


# ----------------------------------------------------------------------------- 3. staged rates
def _staged_rates(groups: dict[str, Any], sizes: list[int]) -> list[dict[str, Any]]:
    """Staged AllToAll against its stages alone on the same bytes, both ranks at once."""
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    dev = _device()
    gloo = groups["gloo"]
    rows = []
    for size in sizes:
        numel = size // 4
        per = numel // n
        peers = numel - per  # what crosses PCIe and the wire: the pieces of the other ranks
        d = torch.randn(numel, device=dev)
        d_out = torch.empty_like(d)
        h = torch.empty(peers, pin_memory=True)
        h_out = torch.empty(peers, pin_memory=True)
        # The host exchange of exactly those bytes: uneven splits with no piece for oneself.
        splits = [0 if j == rank else per for j in range(n)]

        def d2h(h: Any = h, d: Any = d, peers: int = peers) -> None:
            h.copy_(d[:peers], non_blocking=True)

        def h2d(d_out: Any = d_out, h: Any = h, peers: int = peers) -> None:
            d_out[:peers].copy_(h, non_blocking=True)

        def host(h_out: Any = h_out, h: Any = h, splits: list[int] = splits) -> None:
            dist.all_to_all_single(h_out, h, splits, splits, group=groups["direct"])

        def collective(path: str, d_out: Any = d_out, d: Any = d) -> Any:
            return lambda: dist.all_to_all_single(d_out, d, group=groups[path])

        # Interleaved repeats: the host exchange's rate drifts by +-15% over seconds on that
        # machine, so the staged collective and its stages are timed alternately.
        runs = {
            "d2h": d2h,
            "host_exchange": host,
            "h2d": h2d,
            "staged": collective("staged"),
            "staged_ucx": collective("staged_ucx"),
            "direct": collective("direct"),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(STAGED_REPEATS):
            for name, fn in runs.items():
                times[name].append(_timed(fn, 1, gloo))
        median = {name: statistics.median(v) for name, v in times.items()}
        stages = {name: median[name] for name in ("d2h", "host_exchange", "h2d")}
        staged, direct = median["staged"], median["direct"]
        row = {
            "size": size,
            "bytes_over_pcie_each_way": peers * 4,
            "stage_ms": {k: 1e3 * v for k, v in stages.items()},
            "staged_ms": 1e3 * staged,
            "staged_ucx_ms": 1e3 * median["staged_ucx"],
            "direct_ms": 1e3 * direct,
            "staged_vs_slowest_stage": max(stages.values()) / staged,
            "staged_algbw_gbps": size / staged / 1e9,
            "direct_algbw_gbps": size / direct / 1e9,
        }
        if "nccl" in groups:
            row["nccl_ms"] = 1e3 * _timed(
                lambda d_out=d_out, d=d: dist.all_to_all_single(d_out, d, group=groups["nccl"]),
                5,
                gloo,
            )
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- 4. overlap
def _overlap(groups: dict[str, Any], sizes: list[int], rounds: int) -> list[dict[str, Any]]:
    """Matmul slowdown on rank 0 while its own collectives (or an SM copy) move bytes."""
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    dev = _device()
    gloo = groups["gloo"]
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    comm = torch.cuda.Stream()
    side = torch.cuda.Stream()

    def matmul_window(slices: list[tuple[Any, Any]] | None = None, copy: Any = None) -> list[Any]:
        """Queues MATMULS matmuls between timing events (rank 0; rank 1 runs none), with one
        slice of side traffic (``copy(*slices[i])`` on the side stream) beside each."""
        if rank != 0:
            return []
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(MATMULS + 1)]
        marks[0].record()
        for i in range(MATMULS):
            if slices:
                side.wait_event(marks[i])
                with torch.cuda.stream(side):
                    copy(*slices[i])
            torch.mm(a, b)
            marks[i + 1].record()
        return marks

    def pcie_copy(host_slice: Any, device_slice: Any) -> None:
        host_slice.copy_(device_slice, non_blocking=True)
        device_slice.copy_(host_slice, non_blocking=True)

    def peer_traffic(copies: list[Any], window: float) -> None:
        """Rank 1: copies in its own process while rank 0 computes, paced over the window."""
        for copy in copies:
            with torch.cuda.stream(side):
                copy()
            time.sleep(window / len(copies))

    def elapsed(marks: Any) -> list[float]:
        return [marks[i].elapsed_time(marks[i + 1]) for i in range(len(marks) - 1)]

    for _ in range(3):
        torch.mm(a, b)
    torch.cuda.synchronize()
    warm = matmul_window()
    torch.cuda.synchronize()
    window_s = _max(sum(elapsed(warm)) / 1e3 if warm else 0.0, gloo)
    rows = []
    for size in sizes:
        numel = size // 4
        x = torch.randn(numel, device=dev)
        y = torch.empty_like(x)
        ops = {
            "staged_all_to_all": (
                groups["staged"],
                lambda g, x=x, y=y: dist.all_to_all_single(y, x, group=g, async_op=True),
            ),
            # Same-GPU direct transfers are DtoD copies (HBM traffic): reported per byte. (The
            # IPC path's are too, and they outlast the window, which left later windows
            # disturbed: left out.)
            "direct_all_to_all": (
                groups["direct"],
                lambda g, x=x, y=y: dist.all_to_all_single(y, x, group=g, async_op=True),
            ),
            "staged_all_gather": (
                groups["staged"],
                lambda g, x=x[: numel // n], y=y: dist.all_gather_into_tensor(
                    y, x, group=g, async_op=True
                ),
            ),
        }
        if "nccl" in groups:
            ops["nccl_all_to_all"] = (groups["nccl"], ops["staged_all_to_all"][1])
        # Collectives per window: enough to outlast it at their back-to-back rate (same count on
        # both ranks), so that every matmul of the window has traffic beside it.
        counts = {}
        for mode, (group, call) in ops.items():

            def back_to_back(group: Any = group, call: Any = call) -> None:
                for _ in range(BACK_TO_BACK):
                    call(group).wait()

            per_call = _timed(back_to_back, 3, gloo) / BACK_TO_BACK
            counts[mode] = max(1, math.ceil(COVER * window_s / per_call))
        sm_bytes = counts["staged_all_to_all"] * size
        per_slice = sm_bytes // 4 // MATMULS
        src = torch.randn(per_slice * MATMULS, device=dev)
        dst = torch.empty_like(src)
        slices = [
            (dst[i * per_slice : (i + 1) * per_slice], src[i * per_slice : (i + 1) * per_slice])
            for i in range(MATMULS)
        ]
        _sm_copy(*slices[0])  # compiled here, not inside a timed window
        # What the staged AllToAll moves over PCIe in a window, each way, as paced slices.
        per_pcie = counts["staged_all_to_all"] * size // 2 // 4 // MATMULS
        host = torch.empty(per_pcie * MATMULS, pin_memory=True)
        dev_buf = torch.randn(per_pcie * MATMULS, device=dev)
        pcie_slices = [
            (host[i * per_pcie : (i + 1) * per_pcie], dev_buf[i * per_pcie : (i + 1) * per_pcie])
            for i in range(MATMULS)
        ]
        peer_pcie = [lambda s=s: pcie_copy(*s) for s in pcie_slices]
        # What the staged AllToAll copies device to device in rank 1's process (its own piece,
        # one copy per collective), without the collectives.
        local = x[: numel // n]
        local_out = torch.empty_like(local)
        peer_local = [lambda dst=local_out, src=local: dst.copy_(src, non_blocking=True)] * counts[
            "staged_all_to_all"
        ]
        # The windows' schedule and figures: overlap_rounds (each window between two without
        # traffic, a "control" window for the method's own noise, medians over rounds).
        comm_ms: dict[str, list[float]] = {m: [] for m in ops}

        def window(
            mode: str,
            ops: Any = ops,
            counts: Any = counts,
            comm_ms: Any = comm_ms,
            slices: Any = slices,
            pcie_slices: Any = pcie_slices,
            peer_pcie: Any = peer_pcie,
            peer_local: Any = peer_local,
        ) -> float | None:
            torch.cuda.synchronize()
            dist.barrier(group=gloo)
            if mode == "sm_copy":
                marks = matmul_window(slices, _sm_copy)
            elif mode == "pcie_copies":
                marks = matmul_window(pcie_slices, pcie_copy)
            else:
                marks = matmul_window()
            if mode == "peer_pcie_copies" and rank == 1:
                peer_traffic(peer_pcie, window_s)
            if mode == "peer_local_copies" and rank == 1:
                peer_traffic(peer_local, COVER * window_s)
            if mode in ops:
                group, call = ops[mode]
                begin, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                with torch.cuda.stream(comm):
                    begin.record()
                    for _ in range(counts[mode]):
                        call(group).wait()  # the comm stream waits for the last copies
                    end.record()
            torch.cuda.synchronize()
            if mode in ops:
                comm_ms[mode].append(begin.elapsed_time(end))
            # The mean matmul (the window's time over its matmuls): every matmul lost counts.
            return statistics.fmean(elapsed(marks)) if rank == 0 else None

        measured = alternated_rounds(
            window,
            [*ops, "sm_copy", "pcie_copies", "peer_pcie_copies", "peer_local_copies"],
            rounds,
            seed=size,
        )
        alone_ms = measured.alone_ms
        if rank == 0:
            rows.append(
                {
                    "size": size,
                    "collectives_per_window": counts,
                    "window_ms": 1e3 * window_s,
                    "rounds": rounds,
                    "matmuls_per_window": MATMULS,
                    "matmul_alone_ms_median": statistics.median(alone_ms),
                    "matmul_alone_ms_range": [min(alone_ms), max(alone_ms)],
                    "slowdown_pct": measured.slowdown_pct(),
                    "slowdown_pct_range": measured.slowdown_pct_range(),
                    "collectives_ms_median": {m: statistics.median(v) for m, v in comm_ms.items()},
                    "sm_copy_bytes_per_window": sm_bytes,
                    "pcie_bytes_per_window_each_way": per_pcie * 4 * MATMULS,
                    "collective_gbps": {
                        m: counts[m] * size / statistics.median(v) / 1e6 for m, v in comm_ms.items()
                    },
                    # Bytes each collective mode moved per millisecond of the matmul window.
                    "gb_per_window": {m: counts[m] * size / 1e9 for m in ops},
                }
            )
    return rows


# ----------------------------------------------------------------------------- driver
# In a rank: the groups the parts use, built once by ``_join_groups``.
_GROUPS: dict[str, Any] = {}


def _join_groups() -> dict[str, Any]:
    """In a rank whose default group (freescale, direct path) the launcher made: every other
    group the parts use. Returns the number of GPUs the ranks use, and whether the rank's
    context is a client of MPS."""
    import torch
    import torch.distributed as dist

    from freescale_comm import FreescaleOptions
    from freescale_comm.cuda import driver

    rank = dist.get_rank()
    timeout = timedelta(seconds=60)
    groups = _GROUPS
    groups["direct"] = None
    # Between ranks of one host: copy-engine pulls through CUDA IPC, and the staging rings.
    groups["ipc"] = dist.new_group(
        backend="freescale", timeout=timeout, pg_options=FreescaleOptions(cuda_path="ipc")
    )
    groups["staged"] = dist.new_group(
        backend="freescale", timeout=timeout, pg_options=FreescaleOptions(cuda_path="staged")
    )
    # The staged path as between hosts (each rank looks as if on a host of its own): the
    # pinned pool and UCX host messages.
    os.environ["FREESCALE_HOST_ID"] = f"comm-gpu-host-{rank}"
    try:
        groups["staged_ucx"] = dist.new_group(
            backend="freescale", timeout=timeout, pg_options=FreescaleOptions(cuda_path="staged")
        )
    finally:
        del os.environ["FREESCALE_HOST_ID"]
    for name, fields in POOL_VARIANTS.items():
        groups[name] = dist.new_group(
            backend="freescale",
            timeout=timeout,
            pg_options=FreescaleOptions(cuda_path="staged", **fields),
        )
    groups["gloo"] = dist.new_group(backend="gloo", timeout=timeout)
    if torch.cuda.device_count() > 1:  # NCCL refuses two ranks on one GPU
        groups["nccl"] = dist.new_group(backend="nccl", timeout=timeout)
    device = torch.cuda.current_device()
    return {"gpus_used": min(2, torch.cuda.device_count()), "mps": driver().shared_by_mps(device)}


def _run_part(name: str, rounds: int) -> dict[str, Any]:
    """In a rank: one part, its result (or its error) and its seconds."""
    import torch.distributed as dist

    groups, sizes = _GROUPS, [64 * MIB, 256 * MIB]
    parts = {
        "correctness": lambda: _correctness(groups),
        "kernels": lambda: _kernels(groups),
        "busbw": lambda: _busbw(groups),
        "latency": lambda: _latency(groups),
        "staged_rates": lambda: _staged_rates(groups, sizes),
        "overlap": lambda: _overlap(groups, sizes, rounds),
    }
    t0 = time.perf_counter()
    try:
        result: Any = parts[name]()
    except Exception as err:  # report and go on: one broken part must not hide the rest
        result = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-2000:]}
    seconds = round(time.perf_counter() - t0, 1)
    print(f"rank {dist.get_rank()}: {name} done in {seconds} s", flush=True)
    return {name: result, f"{name}_s": seconds}


def _table(report: dict[str, Any]) -> str:
    lines = ["== freescale_comm on GPU =="]
    info = report["info"]
    ranks = report.get("ranks", {})
    lines.append(
        f"torch {info['torch']}  UCX {info['ucx']}  NCCL {info['nccl']}  transports "
        f"{','.join(info['ucx_transports'])}  GPUs used {ranks.get('gpus_used')}  "
        f"MPS {'on' if ranks.get('mps') else 'off'}"
    )
    corr = ranks.get("correctness")
    if isinstance(corr, dict) and "cases" in corr:
        for row in corr["cases"]:
            bad = [k for k, v in row["checks"].items() if not v]
            lines.append(
                f"correct {row['path']:<7} {row['dtype']:<15} "
                f"{row['bytes_per_rank']:>9} B "
                f"{'OK' if row['all_ranks_ok'] else 'FAIL ' + ','.join(bad)}"
            )
        for row in corr["stream_semantics"]:
            lines.append(f"stream  {row}")
    else:
        lines.append(f"correctness: {corr}")
    kern = ranks.get("kernels")
    if isinstance(kern, dict) and "error" not in kern:
        for path, row in kern.items():
            lines.append(
                f"profiler {path:<18} kernels={row['kernels']} memcpys={row['memcpys']} "
                f"{row['kernel_names']} {row['memcpy_kinds']}"
            )
    else:
        lines.append(f"kernels: {kern}")
    bw = ranks.get("busbw")
    if isinstance(bw, list):
        for row in bw:
            lines.append(
                f"busbw {row['path']:<10} {row['op']:<10} {row['size'] // MIB:>5} MiB: "
                f"{row['ms']:8.2f} ms  algbw {row['algbw_gbps']:6.1f}  busbw "
                f"{row['busbw_gbps']:6.1f} GB/s"
            )
    else:
        lines.append(f"busbw: {bw}")
    lat = ranks.get("latency")
    if isinstance(lat, list):
        for row in lat:
            lines.append(
                f"latency {row['path']:<10} {row['bytes']:>8} B: host {row['host_ms']:.3f} ms, "
                f"until done {row['done_ms']:.3f} ms, back to back {row['back_to_back_ms']:.3f} "
                "ms/call"
            )
    else:
        lines.append(f"latency: {lat}")
    rates = ranks.get("staged_rates")
    if isinstance(rates, list):
        for row in rates:
            st = row["stage_ms"]
            lines.append(
                f"staged {row['size'] // MIB:>4} MiB a2a: d2h {st['d2h']:.2f} ms, host "
                f"{st['host_exchange']:.2f} ms, h2d {st['h2d']:.2f} ms -> staged "
                f"{row['staged_ms']:.2f} ms = {100 * row['staged_vs_slowest_stage']:.0f}% of the "
                f"slowest stage's rate; staged over UCX {row['staged_ucx_ms']:.2f} ms; direct "
                f"{row['direct_ms']:.2f} ms"
                + (f"; nccl {row['nccl_ms']:.2f} ms" if "nccl_ms" in row else "")
            )
    else:
        lines.append(f"staged rates: {rates}")
    over = ranks.get("overlap")
    if isinstance(over, list):
        for row in over:
            slow = ", ".join(f"{m} {v:+.2f}%" for m, v in row["slowdown_pct"].items())
            gbps = ", ".join(f"{m} {v:.1f}" for m, v in row["collective_gbps"].items())
            lines.append(
                f"overlap {row['size'] // MIB:>4} MiB: matmul alone "
                f"{row['matmul_alone_ms_median']:.3f} ms "
                f"({row['rounds']} rounds x {row['matmuls_per_window']}); "
                f"slowdown {slow}; collectives GB/s {gbps}; per window "
                f"{row['collectives_per_window']}"
            )
    else:
        lines.append(f"overlap: {over}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Matmul slowdown per mode and the staged path against its stages, one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = report["ranks"]
    fig, (left, right, bw) = plt.subplots(1, 3, figsize=(19, 4.5))
    rows_bw = ranks.get("busbw") or []
    for name, op in sorted({(r["path"], r["op"]) for r in rows_bw}):
        mine = [r for r in rows_bw if r["path"] == name and r["op"] == op]
        bw.plot(
            [r["size"] // MIB for r in mine],
            [r["busbw_gbps"] for r in mine],
            marker="o",
            label=f"{name} {op}",
        )
    # Two ranks on one GPU share its PCIe link: each direction carries both ranks' pieces.
    bw.axhline(PCIE_GBPS / 2, color="gray", linestyle="--", linewidth=0.8, label="PCIe bound")
    bw.set_xscale("log", base=2)
    bw.set_yscale("log")
    bw.set_xlabel("MiB per rank")
    bw.set_ylabel("busbw GB/s (slower rank, median)")
    bw.set_title("2 ranks sharing one H200")
    bw.legend(fontsize=7)
    rows = ranks.get("overlap") or []
    modes = list(rows[0]["slowdown_pct"]) if rows else []
    width = 0.8 / max(1, len(rows))
    for k, row in enumerate(rows):
        low = [row["slowdown_pct"][m] - row["slowdown_pct_range"][m][0] for m in modes]
        high = [row["slowdown_pct_range"][m][1] - row["slowdown_pct"][m] for m in modes]
        left.bar(
            [i + k * width for i in range(len(modes))],
            [row["slowdown_pct"][m] for m in modes],
            width,
            yerr=[low, high],
            capsize=2,
            label=f"{row['size'] // MIB} MiB collectives",
        )
    left.axhline(2, color="gray", linestyle="--", linewidth=0.8)
    left.set_xticks(
        [i + width * (len(rows) - 1) / 2 for i in range(len(modes))], modes, rotation=30, ha="right"
    )
    left.set_ylabel("matmul slowdown %, median (bars: range)")
    left.set_title("Overlap inside one process (H200)")
    left.legend()
    rates = ranks.get("staged_rates") or []
    labels = ["d2h", "host_exchange", "h2d", "staged", "staged_ucx", "direct"]
    for k, row in enumerate(rates):
        values = [
            *(row["stage_ms"][name] for name in labels[:3]),
            row["staged_ms"],
            row.get("staged_ucx_ms", 0),
            row["direct_ms"],
        ]
        right.bar(
            [i + k * 0.4 for i in range(len(labels))],
            values,
            0.4,
            label=f"{row['size'] // MIB} MiB AllToAll",
        )
    right.set_xticks([i + 0.2 for i in range(len(labels))], labels)
    right.set_yscale("log")
    right.set_ylabel("ms (median)")
    right.set_title("Staged path vs its stages alone (2 ranks, 1 GPU)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@contextlib.contextmanager
def _mps_server() -> Iterator[dict[str, str]]:
    """An MPS control daemon of this script's own (pipe and log directories in a temporary
    folder); yields the environment that makes a process started with it a client of its
    server (this process is not one: the daemon stops only once its clients have exited).
    Stopped and its folder removed at the end."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        raise SystemExit("--mps: nvidia-cuda-mps-control is not on PATH")
    root = Path(tempfile.mkdtemp(prefix="freescale-mps-"))
    env = dict(os.environ)
    for name, folder in (("CUDA_MPS_PIPE_DIRECTORY", "pipe"), ("CUDA_MPS_LOG_DIRECTORY", "log")):
        (root / folder).mkdir()
        env[name] = str(root / folder)
    subprocess.run([control, "-d"], env=env, check=True, timeout=30)
    try:
        yield {"CUDA_MPS_PIPE_DIRECTORY": env["CUDA_MPS_PIPE_DIRECTORY"]}
    finally:
        try:
            subprocess.run([control], input=b"quit\n", env=env, timeout=30, check=False)
            shutil.rmtree(root, ignore_errors=True)
        except subprocess.TimeoutExpired:  # a client still attached: the daemon holds the GPU
            print(
                f"--mps: the MPS daemon did not stop within 30 s; stop it with: echo quit | "
                f"CUDA_MPS_PIPE_DIRECTORY={env['CUDA_MPS_PIPE_DIRECTORY']} {control}",
                file=sys.stderr,
            )


def main(argv: list[str] | None = None) -> int:
    """Runs the parts as the command line says (or draws a saved report); 0."""
    parser = argparse.ArgumentParser(prog="comm_gpu")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/comm_gpu")))
    parser.add_argument("--rounds", type=int, default=20, help="overlap rounds (48 matmuls each)")
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}"
    )
    parser.add_argument("--plot", type=Path, help="only draw the figure of a saved JSON report")
    parser.add_argument(
        "--mps", action="store_true", help="run the ranks as clients of an MPS server of its own"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.parts.split(",")) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {','.join(unknown)} (choose from {','.join(PARTS)})")
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return 0
    with _mps_server() if args.mps else contextlib.nullcontext({}) as rank_env:
        return _measure(args, rank_env)


def _measure(args: argparse.Namespace, rank_env: dict[str, str]) -> int:
    """Runs the parts the command line names on ranks whose environment adds ``rank_env``, and
    writes the report; 0."""
    from freescale_comm import FreescaleOptions
    from freescale_comm._local_ranks import GroupSpec, LocalGroup, RankFailure
    from freescale_comm.info import collect

    report: dict[str, Any] = {"info": collect(), "ranks": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    # Rank r on GPU r % device count, its default group freescale on the direct path.
    spec = GroupSpec(
        2,
        "freescale",
        init_timeout_s=60.0,
        setup="freescale_comm:register",
        threads=None,
        device="cuda",
        pg_options=FreescaleOptions(cuda_path="direct"),
        env=rank_env,  # read at each rank's first CUDA call, after the fork server's import
    )
    deadline = time.monotonic() + args.timeout
    group = LocalGroup.of(spec)
    try:
        group.start(args.timeout)
        left = deadline - time.monotonic()
        joined = group.run(_join_groups, timeout_s=left, stop_on_error=True)
        report["ranks"].update(joined[0])
        for name in args.parts.split(","):
            left = deadline - time.monotonic()
            replies = group.run(_run_part, name, args.rounds, timeout_s=left, stop_on_error=True)
            report["ranks"].update(replies[0])  # rank 0's figures (rank 0 computes, rank 1 helps)
            # Written after every part: a later hang still leaves the earlier results.
            (args.out / "comm_gpu.json").write_text(json.dumps(report, indent=2, default=str))
    except RankFailure as failure:  # a rank died or ran past the deadline: the launcher ended it
        report["killed"] = [f"rank {r}: {kind}" for r, (kind, _) in failure.failures.items()]
        report["rank_failure"] = str(failure)[-4000:]
    finally:
        group.close()
    (args.out / "comm_gpu.json").write_text(json.dumps(report, indent=2, default=str))
    try:
        plot(report, args.out / "comm_gpu.png")
    except Exception as err:  # no matplotlib on the GPU machine: draw it later with --plot
        print(f"no plot: {type(err).__name__}: {err}")
    print(_table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
