"""Part 4, sweep (nccl-tests style): time, algbw and busbw per op, size and backend, each
result checked."""

from __future__ import annotations

import statistics
import time
from typing import Any

from .context import (
    Ctx,
    allgather,
    barrier,
    collective,
    describe_error,
    iters_for,
    pattern,
    time_iters,
    time_ok,
    views,
)
from .settings import OPS
from .sizes import fmt_size, geometry, sweep_sizes, uneven_counts


def run_sweep(ctx: Ctx, deadline: float) -> dict[str, Any]:
    """Part 4: every op, size and backend timed and checked (nccl-tests' sizes and busbw)."""
    import torch

    args, n, rank = ctx.args, ctx.n, ctx.rank
    sizes = sweep_sizes(args.min_bytes, args.max_bytes, args.factor)
    rows: list[dict[str, Any]] = []
    skipped = None
    last_cost = 0.0
    for nbytes in sizes:
        if not time_ok(ctx, 2.5 * last_cost + 1.0, deadline):
            skipped = f"sizes from {fmt_size(nbytes)} on: time budget"
            break
        t_size = time.time()
        for op in OPS:
            count, in_n, out_n, splits = geometry(op, nbytes, n, rank)
            base_in = pattern(rank, 0, in_n, ctx.dev)
            base_out = torch.empty(out_n, device=ctx.dev)
            warmup, iters = iters_for(nbytes)
            for backend in ctx.backends():
                group = ctx.groups[backend]
                ctx.progress("sweep", backend)
                barrier(ctx)
                try:
                    inp, out = views(ctx, backend, base_in, base_out)
                    out.fill_(-1)

                    def call(
                        group: Any = group,
                        out: Any = out,
                        inp: Any = inp,
                        op: str = op,
                        splits: Any = splits,
                    ) -> None:
                        collective(op, group, out, inp, splits)

                    times = time_iters(ctx, call, warmup, iters)
                    local: Any = {
                        "t": statistics.median(times),
                        "t_min": min(times),
                        "ok": _check(op, out, n, rank, count, ctx.dev),
                    }
                except Exception as err:
                    local = {"error": describe_error(err)}
                per_rank = allgather(ctx, local)
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
            torch.equal(out[j * per : (j + 1) * per], pattern(j, 0, per, dev)) for j in range(n)
        )
    if op == "all_to_all_single":
        per = count // n
        return all(
            torch.equal(out[j * per : (j + 1) * per], pattern(j, rank * per, per, dev))
            for j in range(n)
        )
    c = uneven_counts(count, n)
    pos, ok = 0, True
    for src in range(n):
        k, offset = c[src][rank], sum(c[src][:rank])
        ok = ok and torch.equal(out[pos : pos + k], pattern(src, offset, k, dev))
        pos += k
    return ok and pos == out.numel()
