"""Host work of one small freescale collective on the CPU: time per call and where it goes.

Two (or more) local ranks run back-to-back 8-byte ``all_to_all_single`` and
``all_gather_into_tensor`` calls on CPU tensors, freescale and a Gloo group in the same
processes, blocks of calls alternating; the figure is the median over blocks of the slower
rank's time per call. With ``--profile`` rank 0 also runs the loop under cProfile and prints
the functions with the most own time, and the time from entering the call to its first posted
message (the host work before anything leaves), on whichever path the call takes: a group on
one host writes its headers (8 bytes of data inside) into its outboxes, ranks of other hosts
send them through UCX; the posts per call on each path are printed beside it.

    python benchmarks/comm_host_profile.py [--ranks 2] [--calls 2000] [--blocks 9] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from datetime import timedelta
from typing import Any

from freescale_comm._freescale_args import Parser, int_at_least
from freescale_comm._local_ranks import GroupSpec, run_ranks_or_exit
from freescale_comm.bench import dist_all_gather_into_tensor


def _rank(args: argparse.Namespace) -> dict[str, Any]:
    """One rank on the launcher's freescale group: the figures (rank 0's are reported)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    timeout = timedelta(seconds=60)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    n = args.ranks
    inp = torch.arange(2 * n, dtype=torch.float32)  # 8 bytes per peer
    out = torch.empty_like(inp)
    ag_in = torch.ones(2)
    ag_out = torch.empty(2 * n)
    gather = dist_all_gather_into_tensor()
    calls = {
        "all_to_all": lambda g: dist.all_to_all_single(out, inp, group=g),
        "all_gather": lambda g: gather(ag_out, ag_in, group=g),
    }
    report: dict[str, Any] = {}
    for op, call in calls.items():
        for backend in (None, gloo):
            for _ in range(200):
                call(backend)
        times: dict[str, list[float]] = {"freescale": [], "gloo": []}
        for block in range(args.blocks):
            order = [("freescale", None), ("gloo", gloo)]
            for name, backend in order if block % 2 == 0 else order[::-1]:
                dist.barrier(group=gloo)
                start = time.perf_counter()
                for _ in range(args.calls):
                    call(backend)
                times[name].append((time.perf_counter() - start) / args.calls)
        t = torch.tensor(times["freescale"] + times["gloo"], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
        slow = t.tolist()
        fs, gl = slow[: args.blocks], slow[args.blocks :]
        report[op] = {
            "freescale_us": statistics.median(fs) * 1e6,
            "gloo_us": statistics.median(gl) * 1e6,
            "freescale_blocks_us": [round(x * 1e6, 1) for x in fs],
            "gloo_blocks_us": [round(x * 1e6, 1) for x in gl],
        }
    if args.profile:
        report["profile"] = _profile(rank, calls, args.calls)
    return report


def _profile(rank: int, calls: dict[str, Any], count: int) -> dict[str, Any]:
    """cProfile of rank 0's freescale loop, and the time to the first posted message."""
    from freescale_comm.outbox import Outboxes
    from freescale_comm.shm import Hub
    from freescale_comm.transport import Transport

    first: list[float] = []
    started = [0.0]
    posts = {"outbox": 0, "shm": 0, "ucx": 0}
    # Every message leaves through one of these: the group's outboxes (the headers of a group
    # on one host), its shared-memory rings (other messages to peers on this host) or UCX.
    posters = [
        (owner, name, path)
        for owner, name, path in (
            (Outboxes, "write", "outbox"),
            (Hub._instance, "post", "shm"),
            (Transport._instance, "send", "ucx"),
            (Transport._instance, "recv", "ucx"),
        )
        if owner is not None
    ]

    def mark(post: Any, path: str) -> Any:
        def posted(*a: Any, **kw: Any) -> Any:
            posts[path] += 1
            if started[0]:
                first.append(time.perf_counter() - started[0])
                started[0] = 0.0
            return post(*a, **kw)

        return posted

    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in posters]
    for owner, name, path in posters:
        setattr(owner, name, mark(getattr(owner, name), path))
    out: dict[str, Any] = {}
    try:
        for op, call in calls.items():
            first.clear()
            posts.update(outbox=0, shm=0, ucx=0)
            for _ in range(count):
                started[0] = time.perf_counter()
                call(None)
            if not first:
                raise RuntimeError(f"{op}: nothing left through the outboxes, rings or UCX")
            out[f"{op}_first_post_us"] = statistics.median(first) * 1e6
            out[f"{op}_posts_per_call"] = {path: n / count for path, n in posts.items()}
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(count):
                call(None)
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(22)
            out[f"{op}_profile"] = text.getvalue() if rank == 0 else ""
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    return out


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int_at_least(2), default=2, help="local ranks")
    parser.add_argument(
        "--calls", type=int_at_least(1), default=2000, help="calls per block (and profiled)"
    )
    parser.add_argument(
        "--blocks", type=int_at_least(1), default=9, help="blocks per backend, alternating"
    )
    parser.add_argument(
        "--profile", action="store_true", help="also profile rank 0 and time its first post"
    )
    parser.add_argument("--json", help="write the figures here (default: print only)")
    args = parser.parse_args()

    spec = GroupSpec(args.ranks, "freescale", setup="freescale_comm:register")
    report = run_ranks_or_exit(spec, _rank, args, timeout_s=600)[0]
    profile = report.pop("profile", {})
    for key, value in profile.items():
        if key.endswith("_us"):
            print(f"{key}: {value:.1f}")
        elif key.endswith("_posts_per_call"):
            print(f"{key}: " + ", ".join(f"{path} {n:g}" for path, n in value.items()))
        else:
            print(f"--- {key} ---\n{value}")
    for op in ("all_to_all", "all_gather"):
        r = report[op]
        print(
            f"{op} 8 B/peer, {args.ranks} ranks: freescale {r['freescale_us']:.1f} us, "
            f"gloo {r['gloo_us']:.1f} us, ratio {r['freescale_us'] / r['gloo_us']:.2f}"
        )
    if args.json:
        report.update({k: v for k, v in profile.items() if not k.endswith("_profile")})
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **report}, f, indent=2)


if __name__ == "__main__":
    main()
