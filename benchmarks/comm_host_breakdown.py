"""Where the host time of a small freescale collective goes, step by step (2 or more local ranks).

Back-to-back ``all_to_all_single`` calls of 4 bytes per peer (or ``--bytes-per-peer``; CPU or
CUDA tensors; with ``--vary-splits``, splits that change on every call, so that no plan is
cached) with the backend's own steps wrapped: per call, the wall time spent inside each step
(inclusive of the steps it calls, so the rows overlap; summed over threads where helper or
reader threads run one) and how often it ran, for every rank. ``--gap-us`` sleeps
after each call (the time per call then includes the sleep, the steps' times do not), so that
the background threads finish the last collective before the next call starts. ``--blocks``
times the calls in that many blocks and reports each block's time per call beside the whole
run's (how much one run spreads); ``--profile N`` runs them under ``cProfile`` on every rank and
lists each rank's N functions of most own time (rank 0's printed; which functions a slower host
runs slower). A diagnostic of this code, to find what a native hot path must replace, not a
comparison (``comm_host_profile.py`` compares with Gloo, ``multi_gpu_vs_nccl.py`` with NCCL). A
wrapper adds about a microsecond per call.

    python benchmarks/comm_host_breakdown.py [--device cuda] [--ranks 2] [--calls 300]
        [--bytes-per-peer 4] [--gap-us 0] [--no-steps] [--blocks 1] [--profile 0] [--vary-splits]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import pstats
import random
import statistics
import time
from typing import Any

from freescale_comm._freescale_args import Parser, byte_size, int_at_least
from freescale_comm._local_ranks import GroupSpec, run_ranks_or_exit

# (module, owner in it or "" for the module itself, function): the steps that are timed.
STEPS = (
    ("process_group", "ProcessGroupFreescale", "all_to_all_single"),
    ("algorithms", "", "all_to_all_single"),
    ("process_group", "", "Collective"),
    ("group", "GroupContext", "launch"),
    ("collective", "Collective", "start"),
    ("collective", "Collective", "_express"),
    ("collective", "Collective", "_post_headers"),
    ("outbox", "Outboxes", "write"),
    ("work", "FreescaleWork", "wait"),
    ("engine", "Engine", "drive"),
    ("engine", "Engine", "_idle"),
    ("transport", "Transport", "progress"),
    ("collective", "Collective", "advance"),
    ("collective", "Collective", "_judge"),
    ("collective", "Collective", "_start_data"),
    ("collective", "Collective", "_seal"),
    ("collective", "Collective", "_finish"),
    ("collective", "Collective", "_read_outboxes"),
    ("collective", "Collective", "_load_header"),
    ("collective", "Collective", "_post_loaded_headers"),
    # CUDA only: the IPC path's steps and the driver calls under them.
    ("cuda", "CudaSupport", "record_ready"),
    ("cuda", "_Driver", "bind"),
    ("collective", "Collective", "_start_ipc"),
    ("ipc", "Export", "__init__"),
    ("ipc", "IpcPath", "push"),
    ("ipc", "IpcPath", "ready"),
    ("ipc", "IpcPath", "enqueue"),
    ("stream_ops", "StreamOps", "run"),
    ("cuda", "CudaSupport", "copy"),
    ("collective", "Collective", "_read_descriptors"),
    # CPU pieces above the rings' limit: the reads at named addresses and the own-piece copies,
    # on the progressing thread or the reader and helper threads (their time adds up per
    # thread), and the progressing thread's sleeps in the epoll.
    ("named_reads", "", "_run"),
    ("named_reads", "PendingReads", "__init__"),
    ("local_copies", "", "host_copies"),
    ("local_copies", "LocalCopies", "start"),
    ("shm", "", "read_process"),
    ("transport", "Transport", "wait_event"),
)


def _wrap_steps(spent: dict[str, int], counts: dict[str, int], cuda: bool) -> None:
    """Replaces each step with a wrapper adding its wall time to ``spent[label]``."""
    import importlib

    import torch

    owners: list[tuple[Any, str, str]] = []
    for module_name, owner_name, name in STEPS:
        if module_name in ("cuda", "ipc", "stream_ops") and not cuda:
            continue
        module = importlib.import_module(f"freescale_comm.{module_name}")
        owner = getattr(module, owner_name) if owner_name else module
        if not hasattr(owner, name):  # a step of another version of the code
            continue
        owners.append((owner, name, f"{owner_name or module_name}.{name}"))
    if cuda:
        owners += [
            (torch.cuda.Event, "record", "torch Event.record"),
            (torch.cuda.Stream, "wait_event", "torch Stream.wait_event"),
        ]
    for owner, name, label in owners:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, _original: Any = original, _label: str = label, **kw: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return _original(*args, **kw)
            finally:
                spent[_label] = spent.get(_label, 0) + time.perf_counter_ns() - start
                counts[_label] = counts.get(_label, 0) + 1

        setattr(owner, name, timed)


def _rank(args: argparse.Namespace) -> dict[str, Any]:
    """One rank on the launcher's freescale group: its steps' time per call."""
    import torch
    import torch.distributed as dist

    cuda = args.device == "cuda"
    spent: dict[str, int] = {}
    counts: dict[str, int] = {}
    if args.steps:
        _wrap_steps(spent, counts, cuda)
    calls = _calls(args, dist.get_rank(), dist.get_world_size())
    for k in range(50):
        dist.all_to_all_single(*calls[k % len(calls)])
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    spent.clear()
    counts.clear()
    gap_s = args.gap_us / 1e6
    profiler = cProfile.Profile() if args.profile else None
    block_us = []
    done = 50  # the warm-up's calls: with --vary-splits each timed call has splits of its own
    start, cpu = time.perf_counter(), time.process_time()
    if profiler is not None:
        profiler.enable()
    for block in _block_sizes(args.calls, args.blocks):
        block_start = time.perf_counter()
        for _ in range(block):
            dist.all_to_all_single(*calls[done % len(calls)])
            done += 1
            if gap_s:
                time.sleep(gap_s)
        block_us.append((time.perf_counter() - block_start) / block * 1e6)
    if profiler is not None:
        profiler.disable()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    if cuda:
        torch.cuda.synchronize()
    steps = {
        label: {"us_per_call": ns / args.calls / 1e3, "runs_per_call": counts[label] / args.calls}
        for label, ns in sorted(spent.items(), key=lambda item: -item[1])
    }
    return {
        "us_per_call": wall / args.calls * 1e6,
        "process_cpu_us_per_call": cpu / args.calls * 1e6,
        "block_us_per_call": block_us,
        "steps": steps,
        "profile": _top_functions(profiler, args.profile) if profiler is not None else [],
    }


def _calls(args: argparse.Namespace, rank: int, n: int) -> list[tuple[Any, ...]]:
    """The (output, input[, output splits, input splits]) of each call: ``--bytes-per-peer``, or
    with ``--vary-splits`` one call per warm-up and timed call, its splits (0-64 floats per
    pair) drawn from a generator seeded alike on every rank, so that the ranks agree."""
    import torch

    if not args.vary_splits:
        inp = torch.ones(n * args.bytes_per_peer // 4, device=args.device)
        return [(torch.empty_like(inp), inp)]
    rng = random.Random(0)
    calls = []
    for _ in range(50 + args.calls):
        table = [[rng.randint(0, 64) for _ in range(n)] for _ in range(n)]
        send, recv = table[rank], [table[peer][rank] for peer in range(n)]
        inp = torch.ones(sum(send), device=args.device)
        calls.append((torch.empty(sum(recv), device=args.device), inp, recv, send))
    return calls


def _block_sizes(calls: int, blocks: int) -> list[int]:
    """``calls`` cut into ``blocks`` nearly equal blocks (no block is empty)."""
    blocks = min(blocks, calls)
    return [(k + 1) * calls // blocks - k * calls // blocks for k in range(blocks)]


def _top_functions(profiler: cProfile.Profile, count: int) -> list[str]:
    """The ``count`` functions of most own time, as ``pstats`` prints them (one row each)."""
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).strip_dirs().sort_stats("tottime").print_stats(count)
    rows = text.getvalue().splitlines()
    header = next(k for k, row in enumerate(rows) if row.lstrip().startswith("ncalls"))
    return [row for row in rows[header:] if row.strip()]


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--ranks",
        type=int_at_least(2),
        default=2,
        help="local ranks (on CUDA: rank r on GPU r %% the GPU count)",
    )
    parser.add_argument("--calls", type=int_at_least(1), default=300, help="calls timed")
    parser.add_argument(
        "--bytes-per-peer",
        type=byte_size,
        default=4,
        help="bytes each rank sends each peer (floats; a multiple of 4, K/M suffixes)",
    )
    parser.add_argument(
        "--gap-us",
        type=int_at_least(0),
        default=0,
        help="sleep this long after each call, so that the background threads (engine, CUDA "
        "event watchers) finish the last collective before the next call starts",
    )
    parser.add_argument(
        "--no-steps",
        dest="steps",
        action="store_false",
        help="time the calls only, without wrapping the steps (what the wrappers add is left out)",
    )
    parser.add_argument(
        "--blocks",
        type=int_at_least(1),
        default=1,
        help="time the calls in this many blocks and print each block's time per call",
    )
    parser.add_argument(
        "--profile",
        type=int_at_least(0),
        default=0,
        metavar="N",
        help="run the calls under cProfile on every rank and keep each rank's N functions of "
        "most own time, rank 0's printed (profiling slows them: the times per call include it)",
    )
    parser.add_argument(
        "--vary-splits",
        action="store_true",
        help="uneven splits that change on every call (no plan is cached), as an embedding "
        "lookup's AllToAll, instead of 4 bytes per peer",
    )
    parser.add_argument("--json", help="write the figures here (default: print only)")
    args = parser.parse_args()
    if args.bytes_per_peer % 4:
        parser.error("--bytes-per-peer must be a multiple of 4 (float32 elements)")

    spec = GroupSpec(
        args.ranks, "freescale", setup="freescale_comm:register", threads=None, device=args.device
    )
    ranks = run_ranks_or_exit(spec, _rank, args, timeout_s=300)
    for rank, report in enumerate(ranks):
        print(
            f"--- rank {rank}: {report['us_per_call']:.1f} us per call, process CPU "
            f"{report['process_cpu_us_per_call']:.1f} us per call"
        )
        blocks = report["block_us_per_call"]
        if len(blocks) > 1:
            print(
                f"blocks of {args.calls // len(blocks)} calls: median "
                f"{statistics.median(blocks):.1f} us per call, {min(blocks):.1f}-{max(blocks):.1f}"
            )
        for label, step in report["steps"].items():
            print(f"{label:40s} {step['us_per_call']:8.1f} us  x{step['runs_per_call']:.2f}")
    if ranks[0]["profile"]:
        print("--- rank 0 under cProfile, by own time (tottime):")
        print("\n".join(ranks[0]["profile"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ranks": ranks}, f, indent=2)


if __name__ == "__main__":
    main()
