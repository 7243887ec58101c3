"""An independent check of ``freescale comm bench``: the method of issue 19's measurement.

Local ranks; the world group on freescale and a Gloo group in the same processes; per size,
blocks of ``--calls`` back-to-back calls, freescale and Gloo blocks alternated (F, G, F, G, ...)
with a barrier before each; the slower rank's time per call; the median of ``--blocks`` blocks.
Unlike the bench it leaves torch's thread settings alone unless ``--threads`` is given (a
training process runs with torch's default, one intra-op thread per core).

    python benchmarks/comm_alternating.py [--ranks 2] [--threads N] [--sizes 8,4096,16M]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from typing import Any

from freescale_comm._freescale_args import byte_size_list
from freescale_comm._local_ranks import GroupSpec, RankFailure, run_ranks


def _rank(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One rank on the launcher's freescale group: every row (rank 0 prints them)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    timeout = timedelta(seconds=120)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    n = args.ranks
    rows = []
    for size in args.sizes:  # bytes one rank receives in all
        for op in args.ops:
            elements = max(n, size // 4 // n * n)
            out = torch.empty(elements)
            if op == "all_to_all":
                inp = torch.rand(elements)

                def call(g: Any, out: torch.Tensor = out, inp: torch.Tensor = inp) -> None:
                    dist.all_to_all_single(out, inp, group=g)
            else:
                inp = torch.rand(elements // n)

                def call(g: Any, out: torch.Tensor = out, inp: torch.Tensor = inp) -> None:
                    dist.all_gather_into_tensor(out, inp, group=g)

            calls = args.calls if size < (1 << 20) else max(3, args.calls // 20)
            for g in (None, gloo):
                for _ in range(5):
                    call(g)
            times: dict[str, list[float]] = {"freescale": [], "gloo": []}
            for _ in range(args.blocks):
                for name, g in (("freescale", None), ("gloo", gloo)):
                    dist.barrier(group=gloo)
                    start = time.perf_counter()
                    for _ in range(calls):
                        call(g)
                    times[name].append((time.perf_counter() - start) / calls)
            t = torch.tensor(times["freescale"] + times["gloo"], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
            slow = t.tolist()
            fs = statistics.median(slow[: args.blocks]) * 1e6
            gl = statistics.median(slow[args.blocks :]) * 1e6
            rows.append({"op": op, "size": elements * 4, "freescale_us": fs, "gloo_us": gl})
            if rank == 0:
                print(
                    f"{op:<11}{elements * 4:>10} B  freescale {fs:10.1f} us  gloo {gl:10.1f} us"
                    f"  ratio {fs / gl:.2f}",
                    flush=True,
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--sizes", type=byte_size_list(), default="8,64,512,4K,16M")
    parser.add_argument("--ops", default="all_to_all,all_gather")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=9)
    parser.add_argument("--json")
    args = parser.parse_args()
    args.ops = args.ops.split(",")

    spec = GroupSpec(
        args.ranks,
        "freescale",
        init_timeout_s=120,
        setup="freescale_comm:register",
        threads=args.threads or None,
    )
    try:
        rows = run_ranks(spec, _rank, args, timeout_s=900)[0]
    except RankFailure as failure:
        raise SystemExit(f"a rank failed: {failure}") from None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "load_avg_1m": os.getloadavg()[0], "rows": rows}, f, indent=2
            )


if __name__ == "__main__":
    main()
