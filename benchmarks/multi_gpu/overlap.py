"""Part 5, overlap: a compute kernel's slowdown while each backend moves data on every rank."""

from __future__ import annotations

import math
import statistics
import threading
import time
from contextlib import nullcontext
from typing import Any

from overlap_rounds import ALONE, CONTROL, ModeDropped, alternated_rounds, windows_per_round

from .context import (
    Ctx,
    allgather,
    barrier,
    collective,
    describe_error,
    pattern,
    sync,
    time_iters,
    time_ok,
    views,
)
from .settings import FREESCALE, OVERLAP_OPS, TARGET_GAP, TARGET_PCT
from .sizes import fmt_size, geometry


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
        kinds["jagged_attention"] = f"error: {describe_error(err)}"
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
        return loop, False, describe_error(err)


def compute_window(ctx: Ctx, run: Any, preroll_cycles: int) -> float:
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
            box["error"] = describe_error(err)

    worker = threading.Thread(target=traffic, name="bench-traffic", daemon=True)
    t0 = time.perf_counter()
    worker.start()
    ms = compute_window(ctx, run, preroll)
    box["window_wall_s"] = time.perf_counter() - t0
    worker.join(timeout=120)
    if worker.is_alive():
        box["error"] = "traffic thread still running after 120 s"
    return ms, box


def run_overlap(ctx: Ctx, deadline: float) -> dict[str, Any]:
    """Part 5: per compute kernel, op and size, each backend's slowdown of the compute."""
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
            per = statistics.median(time_iters(ctx, compute, 1, 5)) * 1e3
            iters = max(allgather(ctx, max(2, min(2000, math.ceil(args.window_ms / per)))))
            run, graphed, why = _graphed(ctx, compute, iters)
            ms = statistics.median(compute_window(ctx, run, preroll_cycles) for _ in range(3))
            window_ms = max(allgather(ctx, ms))
            runs[kind] = (run, window_ms)
            result[f"{kind}_status"] = {
                "per_call_ms": round(per, 4),
                "calls_per_window": iters,
                "window_ms": round(window_ms, 3),
                "cuda_graph": graphed,
                "graph_error": why,
            }
        except Exception as err:
            result[f"{kind}_status"] = f"error: {describe_error(err)}"
    backends = ctx.backends()
    for kind, (run, window_ms) in runs.items():
        for op in OVERLAP_OPS:
            for nbytes in args.overlap_sizes:
                windows = args.rounds * windows_per_round(len(backends))
                est = windows * (window_ms + preroll_ms) * 3e-3 + 5
                if not time_ok(ctx, est, deadline):
                    result["combos"].append(
                        {"compute": kind, "op": op, "bytes": nbytes, "skipped": "time budget"}
                    )
                    continue
                try:
                    combo = _overlap_combo(
                        ctx, kind, run, window_ms, preroll_ms, preroll_cycles, op, nbytes, side
                    )
                except Exception as err:  # an error here is the same on every rank
                    combo = {
                        "compute": kind,
                        "op": op,
                        "bytes": nbytes,
                        "error": describe_error(err),
                    }
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
    count, in_n, out_n, splits = geometry(op, nbytes, n, rank)
    base_in = pattern(rank, 0, in_n, ctx.dev)
    base_out = torch.empty(out_n, device=ctx.dev)
    calls: dict[str, Any] = {}
    counts: dict[str, int] = {}
    errors: dict[str, str] = {}
    for backend in ctx.backends():
        group = ctx.groups[backend]
        ctx.progress("overlap", backend)
        barrier(ctx)
        try:
            inp, out = views(ctx, backend, base_in, base_out)

            def call(group: Any = group, out: Any = out, inp: Any = inp) -> None:
                collective(op, group, out, inp, splits)

            local: Any = statistics.median(time_iters(ctx, call, 1, 3))
            calls[backend] = call
        except Exception as err:
            local = {"error": describe_error(err)}
        per_rank = allgather(ctx, local)
        bad = [r for r in per_rank if isinstance(r, dict)]
        if bad:
            errors[backend] = bad[0]["error"]
            calls.pop(backend, None)
            continue
        once_ms = max(per_rank) * 1e3
        count = max(2, min(5000, math.ceil(1.3 * (window_ms + preroll_ms) / once_ms) + 1))
        # The same on every rank: ``preroll_ms`` is each rank's own, and a rank that called one
        # collective more than its peers waited out the group timeout.
        counts[backend] = max(allgather(ctx, count))
    samples: dict[str, list[float]] = {m: [] for m in (ALONE, *calls, CONTROL)}
    comm_s: dict[str, list[float]] = {m: [] for m in calls}

    def window(mode: str) -> float:
        """One compute window on this rank, with ``mode``'s traffic beside it."""
        sync(ctx)
        barrier(ctx)
        if mode in (ALONE, CONTROL):
            ms = compute_window(ctx, run, preroll_cycles)
            samples[mode].append(ms)
            return ms
        ctx.progress("overlap", mode)
        ms, box = _window_with_traffic(ctx, run, preroll_cycles, calls[mode], counts[mode], side)
        failed = [e for e in allgather(ctx, box.get("error")) if e]
        if failed:  # every rank drops the backend from the later rounds
            errors[mode] = failed[0]
            calls.pop(mode)
            raise ModeDropped(mode)
        samples[mode].append(ms)
        comm_s[mode].append(box["comm_s"])
        return ms

    measured = alternated_rounds(window, list(calls), ctx.args.rounds, seed=nbytes)
    kept = (*calls, CONTROL)  # the backends still running and the control
    slowdown_here, range_here = measured.slowdown_pct(), measured.slowdown_pct_range()
    samples = {m: v for m, v in samples.items() if v and (m in (ALONE, CONTROL) or m in calls)}
    comm_s = {m: v for m, v in comm_s.items() if m in calls}
    local = {
        "median_ms": {m: statistics.median(v) for m, v in samples.items()},
        "samples_ms": {m: [round(x, 4) for x in v] for m, v in samples.items()},
        "comm_s": {m: statistics.median(v) for m, v in comm_s.items()},
        "slowdown_pct": {m: slowdown_here[m] for m in kept},
        "slowdown_pct_range": {m: range_here[m] for m in kept},
    }
    per_rank = allgather(ctx, local)
    slowdown: dict[str, list[float]] = {}
    gbps: dict[str, list[float]] = {}
    coverage: dict[str, list[float]] = {}
    # Each backend's median ratio to its neighbouring windows alone, and the control's (the
    # method's own noise) beside them.
    for mode in kept:
        slowdown[mode] = [round(r["slowdown_pct"][mode], 3) for r in per_rank]
    for backend in calls:
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
        "alone_ms": [round(r["median_ms"][ALONE], 4) for r in per_rank],
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
