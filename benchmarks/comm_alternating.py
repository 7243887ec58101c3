"""An independent check of ``freescale comm bench``: the method of issue 19's measurement.

Local ranks; one freescale group per ``--variant`` (its options) and the Gloo world group, in
the same processes; per size, blocks of back-to-back calls, as many as the slowest group makes
in about ``--target-s`` by its warm-up (at most ``--calls``, at least 3; the same on every
rank), so that the barrier before each block weighs as little at 64 MiB as at 8 B; the groups'
blocks alternated (F, G, F, G, ...; the order reversed every other round);
the slower rank's time per call; the median of ``--blocks`` blocks; in brackets, the CPU
time per call of the rank that used most (its process, every thread). With ``--device cuda`` the
tensors are on each rank's GPU, a block ends when its GPU work has, and the variants are
compared with the first one (Gloo has no CUDA AllToAll). Two variants with the same
options (``--variant a --variant b``) measure the noise of the method itself: the ratio of two
identical groups. Unlike the bench it leaves torch's thread settings alone unless ``--threads``
is given (a training process runs with torch's default, one intra-op thread per core).
``--in-flight N`` issues the calls of a block N at a time, asynchronously, each into an output
of its own, then waits for the N (as a pipeline with collectives in flight does);
``--async-op`` issues every call asynchronously, the last one too, and waits for it (as a
caller that starts a collective and waits for it later does).
``--ops send_recv``: every rank sends its input to the next rank and receives the previous
one's (point-to-point, which a freescale group runs on its Gloo backend).
``--work-mib M`` puts CPU work before each call (or batch), as a training step computes between
its collectives: every rank copies M MiB between two tensors of its own. The ranks then reach a
call at different times, and a rank that waits for a peer still at work shares the cores with
it. A ``work`` row, blocks of the work alone in the same rotation, is subtracted: the figures
are what a call adds to the work (the slower rank's block time per call, less the work's).
The ranks inherit the environment: with ``THP_MEM_ALLOC_ENABLE=1`` their torch asks for huge pages
for tensors of 2 MiB and more, as ``freescale comm bench --huge-pages`` does (the JSON records
the variable).

    python benchmarks/comm_alternating.py [--ranks 2] [--threads N] [--device cpu|cuda]
        [--hosts N] [--sizes 8,4096,16M] [--in-flight 1] [--async-op] [--work-mib 0] [--calls 200]
        [--target-s 0.05]
        [--variant NAME[:FIELD=VALUE,...]]...   (default: one variant "freescale", defaults)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
from datetime import timedelta
from typing import Any

from freescale_comm import FreescaleOptions
from freescale_comm._freescale_args import byte_size_list
from freescale_comm._local_ranks import GroupSpec, run_ranks_or_exit
from freescale_comm.bench import dist_all_gather_into_tensor
from freescale_comm.info import page_settings
from freescale_comm.options import _parse
from freescale_comm.shm import HOST_ENV


def _variant(text: str) -> tuple[str, FreescaleOptions]:
    """``NAME[:FIELD=VALUE,...]`` -> (name, its options; values parsed as their ``FREESCALE_*``
    environment variables are)."""
    name, _, fields = text.partition(":")
    if not name or name == "gloo":
        raise argparse.ArgumentTypeError(f"{text!r}: a variant needs a name other than gloo")
    defaults = FreescaleOptions()
    known = {f.name for f in dataclasses.fields(FreescaleOptions)}
    values: dict[str, Any] = {}
    for item in filter(None, fields.split(",")):
        field, sep, value = item.partition("=")
        if not sep or field not in known:
            raise argparse.ArgumentTypeError(f"{item!r} is not FIELD=VALUE of FreescaleOptions")
        try:
            values[field] = _parse(value, type(getattr(defaults, field)), field)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    try:
        return name, dataclasses.replace(defaults, **values)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _rank(args: argparse.Namespace) -> dict[str, Any]:
    """One rank on the launcher's Gloo group: every row (rank 0 prints them), and per variant
    the path its host bytes take to the next rank and why (``paths``: on one host, what the
    rings' limit is and how it was chosen)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    timeout = timedelta(seconds=120)
    if args.hosts:  # the freescale groups see the ranks as if on that many hosts
        os.environ[HOST_ENV] = f"alternating-host-{rank * args.hosts // args.ranks}"
    groups: dict[str, Any] = {
        name: dist.new_group(backend="freescale", timeout=timeout, pg_options=options)
        for name, options in args.variant
    }
    if args.hosts:
        del os.environ[HOST_ENV]
    cuda = args.device == "cuda"
    asynchronous = args.async_op
    if not cuda:  # CUDA tensors: the variants against each other (Gloo has no CUDA AllToAll)
        groups["gloo"] = None  # the world group
    names = list(groups)
    reference = "gloo" if not cuda else names[0]
    work_from = work_to = None
    if args.work_mib:
        work_from = torch.rand(args.work_mib << 18)
        work_to = torch.empty_like(work_from)
        names.append("work")  # a row of its own: the work alone, in the same rotation
    n = args.ranks
    paths = {}
    for name, group in groups.items():
        if group is not None:
            row = next(
                (r for r in group.paths() if r["peer"] == (rank + 1) % n),
                {"path": "none", "why": "one rank: its own pieces only"},
            )
            paths[name] = {"path": row["path"], "why": row["why"]}
            if rank == 0:
                print(f"{name}: {row['path']} ({row['why']})", flush=True)
    rows = []
    gather = dist_all_gather_into_tensor()
    for size in args.sizes:  # bytes one rank receives in all
        for op in args.ops:
            elements = max(n, size // 4 // n * n)
            outs = [torch.empty(elements, device=args.device) for _ in range(args.in_flight)]
            if op == "all_to_all":
                inp = torch.rand(elements, device=args.device)

                def call(g: Any, k: int = 0, inp: torch.Tensor = inp, outs: list = outs) -> Any:
                    return dist.all_to_all_single(
                        outs[k], inp, group=g, async_op=k > 0 or asynchronous
                    )
            elif op == "send_recv":
                inp = torch.rand(elements, device=args.device)

                def call(g: Any, k: int = 0, inp: torch.Tensor = inp, outs: list = outs) -> Any:
                    sent = dist.isend(inp, (rank + 1) % n, group=g)
                    dist.recv(outs[k], (rank - 1) % n, group=g)
                    sent.wait()
            else:
                inp = torch.rand(elements // n, device=args.device)

                def call(g: Any, k: int = 0, inp: torch.Tensor = inp, outs: list = outs) -> Any:
                    return gather(outs[k], inp, group=g, async_op=k > 0 or asynchronous)

            def batch(name: str, call: Any = call) -> None:
                """The work, if any, then ``--in-flight`` calls: the first N - 1 asynchronous
                (every one with ``--async-op``), then every wait (none for the ``work`` row)."""
                if work_from is not None:
                    work_to.copy_(work_from)
                if name == "work":
                    return
                g = groups[name]
                works = [call(g, k) for k in range(args.in_flight - 1, -1, -1)]
                for work in works if asynchronous else works[:-1]:
                    work.wait()

            warm = []  # each group's time per call over the last 3 of its 5 warm-up batches
            for name in names:
                for _ in range(2):  # the first calls of a shape build and cache its plan
                    batch(name)
                start = time.perf_counter()
                for _ in range(3):
                    batch(name)
                if cuda:
                    torch.cuda.synchronize()
                warm.append((time.perf_counter() - start) / (3 * args.in_flight))
            slowest = torch.tensor([max(warm)], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # every rank makes as many calls
            calls = max(3, min(args.calls, math.ceil(args.target_s / slowest.item())))
            calls = max(1, calls // args.in_flight)  # batches of --in-flight calls
            times: dict[str, list[float]] = {name: [] for name in names}
            cpu: dict[str, list[float]] = {name: [] for name in names}
            for block in range(args.blocks):
                for name in names if block % 2 == 0 else names[::-1]:
                    dist.barrier()
                    start, cpu_start = time.perf_counter(), time.process_time()
                    for _ in range(calls):
                        batch(name)
                    if cuda:
                        torch.cuda.synchronize()
                    per_call = calls * args.in_flight
                    times[name].append((time.perf_counter() - start) / per_call)
                    cpu[name].append((time.process_time() - cpu_start) / per_call)
            # Per block the slower rank's time, and the CPU time of the rank that used most
            # (every thread of its process: the backend's own threads count).
            t = torch.tensor(
                [x for table in (times, cpu) for name in names for x in table[name]],
                dtype=torch.float64,
            )
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            slow = t.tolist()
            row: dict[str, Any] = {
                "op": op,
                "size": elements * 4,
                "calls_per_block": calls * args.in_flight,
            }
            for k, name in enumerate(names):
                blocks = slow[k * args.blocks : (k + 1) * args.blocks]
                row[f"{name}_us"] = statistics.median(blocks) * 1e6
                at = (len(names) + k) * args.blocks
                row[f"{name}_cpu_us"] = statistics.median(slow[at : at + args.blocks]) * 1e6
            if args.work_mib:  # what a call adds to the work
                for name in groups:
                    row[f"{name}_added_us"] = row[f"{name}_us"] - row["work_us"]
            rows.append(row)
            if rank == 0:
                key = "_added_us" if args.work_mib else "_us"
                line = "  ".join(
                    f"{name} {row[f'{name}{key}']:9.1f} us"
                    + f" [cpu {row[f'{name}_cpu_us']:.0f}]"
                    + (
                        f" ({row[f'{name}{key}'] / row[f'{reference}{key}']:.2f})"
                        if name != reference
                        else ""
                    )
                    for name in names
                    if name != "work"
                )
                if args.work_mib:
                    line += f"  (added to work {row['work_us']:.1f} us per call)"
                print(f"{op:<11}{elements * 4:>10} B  {line}", flush=True)
    return {"rows": rows, "paths": paths}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument(
        "--hosts", type=int, default=0, help="make the ranks look as if on this many hosts"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: rank r on GPU r %% count, the variants against the first (no Gloo column)",
    )
    parser.add_argument("--sizes", type=byte_size_list(), default="8,64,512,4K,16M")
    parser.add_argument("--ops", default="all_to_all,all_gather")
    parser.add_argument("--calls", type=int, default=200, help="the most calls in one block")
    parser.add_argument(
        "--target-s",
        type=float,
        default=0.05,
        help="about how long the slowest group's block of calls lasts",
    )
    parser.add_argument("--blocks", type=int, default=9)
    parser.add_argument(
        "--in-flight", type=int, default=1, help="calls issued asynchronously before the waits"
    )
    parser.add_argument(
        "--async-op", action="store_true", help="every call asynchronous, the last one too"
    )
    parser.add_argument(
        "--work-mib",
        type=int,
        default=0,
        help="MiB every rank copies before each call (or batch), a work row subtracted",
    )
    parser.add_argument(
        "--variant",
        type=_variant,
        action="append",
        help="NAME[:FIELD=VALUE,...] a freescale group with these options (repeatable)",
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    args.ops = args.ops.split(",")
    if not set(args.ops) <= {"all_to_all", "all_gather", "send_recv"}:
        parser.error("--ops: all_to_all, all_gather, send_recv")
    if "send_recv" in args.ops and (args.in_flight > 1 or args.async_op or args.device == "cuda"):
        parser.error("--ops send_recv: CPU tensors, one call in flight")
    args.variant = args.variant or [("freescale", FreescaleOptions())]
    if len({name for name, _ in args.variant}) != len(args.variant):
        parser.error("variant names must differ")
    if args.calls < 3 or not args.target_s > 0:
        parser.error("--calls must be at least 3 and --target-s positive")
    if args.work_mib < 0 or (args.work_mib and args.device == "cuda"):
        parser.error("--work-mib must be at least 0, and is CPU work for CPU collectives")

    spec = GroupSpec(
        args.ranks,
        "gloo",
        init_timeout_s=120,
        setup="freescale_comm:register",
        threads=args.threads or None,
        device=args.device,
    )
    result = run_ranks_or_exit(spec, _rank, args, timeout_s=1800)[0]
    if args.json:
        with open(args.json, "w") as f:
            report = {
                "args": {**vars(args), "variant": [(n, repr(o)) for n, o in args.variant]},
                "load_avg_1m": os.getloadavg()[0],
                **page_settings(),
                "paths": result["paths"],
                "rows": result["rows"],
            }
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
