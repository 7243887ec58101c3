"""A 4-rank CPU AllToAll of SIZE bytes per rank in a plain loop on the world group of one
backend (no other calls between): each rank's median time per call and its process CPU time
per call; with ``--profile``, rank 0's 18 functions of most own time under cProfile.

    python benchmarks/results/comm_cpu/bench_fast_gloo_host/plain_loop.py SIZE
        [--backend freescale|gloo] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ranks import this module

CALLS = 200


def all_to_all_loop(size: int, profile: bool) -> dict:
    """In a rank: 20 warm-up calls, then ``CALLS`` timed ones."""
    import torch
    import torch.distributed as dist

    x = torch.full((size // 4,), float(dist.get_rank()))
    y = torch.empty_like(x)
    for _ in range(20):
        dist.all_to_all_single(y, x)
    profiler = cProfile.Profile() if profile else None
    times = []
    cpu_start = time.process_time()
    if profiler:
        profiler.enable()
    for _ in range(CALLS):
        start = time.perf_counter()
        dist.all_to_all_single(y, x)
        times.append(time.perf_counter() - start)
    if profiler:
        profiler.disable()
    cpu = (time.process_time() - cpu_start) / CALLS
    text = ""
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
        text = out.getvalue()
    return {"median_us": 1e6 * statistics.median(times), "cpu_us": 1e6 * cpu, "profile": text}


def main() -> None:
    import plain_loop

    from freescale_comm._local_ranks import LocalGroup

    parser = argparse.ArgumentParser()
    parser.add_argument("size", type=int)
    parser.add_argument("--backend", choices=("freescale", "gloo"), default="freescale")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    setup = "freescale_comm:register" if args.backend == "freescale" else None
    group = LocalGroup(4, backend=args.backend, setup=setup, init_timeout_s=60)
    group.start()
    try:
        reports = group.run(plain_loop.all_to_all_loop, args.size, args.profile, timeout_s=300)
    finally:
        group.close()
    for rank, report in enumerate(reports):
        print(
            f"rank {rank}: median {report['median_us']:.0f} us, process CPU "
            f"{report['cpu_us']:.0f} us per call"
        )
    if args.profile:
        print(reports[0]["profile"])


if __name__ == "__main__":
    main()
