"""How the first calls of a block compare with the later ones: freescale's and Gloo's
``all_to_all_single`` on CPU tensors, each call of a block timed alone.

Local ranks run blocks of ``--calls`` back-to-back calls of one backend, after a gap of the
kind ``--gap`` names: ``none`` (the same backend's previous block, a barrier between: calls
back to back), ``sleep`` (``--gap-ms`` asleep after the barrier) or ``other`` (the other
backend's block, as ``freescale comm bench`` alternates them). Per backend and position in the
block: the median over blocks of the slowest rank's time of that call, and the block's mean,
which is what a bench block of that many calls reports. Outputs are reused from call to call,
as in the bench. ``--bare`` adds the copies alone as a third backend (``BARE``), to tell the
machine's own slow start from the backends'.

    python benchmarks/comm_first_calls.py [--ranks 4] [--size 32M] [--calls 7] [--blocks 8]
        [--gap none|sleep|other] [--gap-ms 90] [--bare] [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from freescale_comm._freescale_args import Parser, byte_size, int_at_least
from freescale_comm._local_ranks import GroupSpec, run_ranks_or_exit

BACKENDS = ("freescale", "gloo")
# Without a backend: each rank reads its piece from every peer's input (``process_vm_readv``, as
# freescale's reads) and copies its own, then a 4-byte freescale AllToAll (its outboxes: tens of
# microseconds) ends the call; the floor of freescale's path, and whether the machine itself
# starts slowly.
BARE = "bare"
WARMUP_CALLS = 5


def _rank(args: argparse.Namespace) -> dict[str, list[list[float]]]:
    """Per backend, per block, each call's time (seconds) on this rank."""
    import torch
    import torch.distributed as dist

    gloo = dist.new_group(backend="gloo")
    names = (*BACKENDS, BARE) if args.bare else BACKENDS
    inp = torch.rand(args.size // 4)
    outputs = {name: torch.empty_like(inp) for name in names}
    calls = {
        name: functools.partial(dist.all_to_all_single, outputs[name], inp, group=group)
        for name, group in (("freescale", None), ("gloo", gloo))
    }
    if args.bare:
        calls[BARE] = _bare_call(inp, outputs[BARE], gloo)
    for name in names:
        for _ in range(WARMUP_CALLS):
            calls[name]()
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    order = [name for block in range(args.blocks) for name in names[:: 1 - 2 * (block % 2)]]
    if args.gap != "other":  # each backend's blocks together, so that none follows another
        order = sorted(order, key=names.index)
    for name in order:
        dist.barrier(group=gloo)
        if args.gap == "sleep":
            time.sleep(args.gap_ms / 1e3)
        block = []
        for _ in range(args.calls):
            start = time.perf_counter()
            calls[name]()
            block.append(time.perf_counter() - start)
        times[name].append(block)
    return times


def _bare_call(inp: Any, out: Any, gloo: Any) -> Callable[[], None]:
    """The ``bare`` call: every peer's piece read from its input, the own piece copied, then a
    4-byte AllToAll on the freescale world, so that no rank starts the next call before every
    peer has read its input."""
    import os

    import numpy as np
    import torch
    import torch.distributed as dist

    from freescale_comm.shm import read_process

    rank, n = dist.get_rank(), dist.get_world_size()
    found: list[Any] = [None] * n
    dist.all_gather_object(found, (os.getpid(), inp.data_ptr()), group=gloo)
    piece = inp.numel() * inp.element_size() // n
    mine, theirs = inp.numpy().view(np.uint8), out.numpy().view(np.uint8)
    local = out.data_ptr()
    ends = torch.zeros(n), torch.zeros(n)

    def call() -> None:
        for peer in range(n):
            if peer == rank:
                np.copyto(
                    theirs[rank * piece : (rank + 1) * piece],
                    mine[rank * piece : (rank + 1) * piece],
                )
                continue
            pid, address = found[peer]
            failed = read_process(pid, local + peer * piece, address + rank * piece, piece)
            if failed is not None:
                raise RuntimeError(f"reading rank {peer}'s piece failed: {failed}")
        dist.all_to_all_single(*ends)

    return call


def summary(ranks: list[dict[str, list[list[float]]]], calls: int) -> dict[str, Any]:
    """Per backend, the median over blocks of the slowest rank's time of each call position
    (ms) and the block mean; the ratio of freescale's block mean to Gloo's."""
    found: dict[str, Any] = {}
    for name in ranks[0]:
        blocks = len(ranks[0][name])
        per_call = [
            statistics.median(
                max(rank[name][block][position] for rank in ranks) for block in range(blocks)
            )
            * 1e3
            for position in range(calls)
        ]
        found[name] = {"per_call_ms": per_call, "block_mean_ms": statistics.mean(per_call)}
    found["freescale_over_gloo"] = (
        found["freescale"]["block_mean_ms"] / found["gloo"]["block_mean_ms"]
    )
    return found


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int_at_least(2), default=4)
    parser.add_argument("--size", type=byte_size, default="32M", help="bytes per rank")
    parser.add_argument("--calls", type=int_at_least(1), default=7, help="calls per block")
    parser.add_argument("--blocks", type=int_at_least(1), default=8, help="blocks per backend")
    parser.add_argument("--gap", choices=("none", "sleep", "other"), default="other")
    parser.add_argument("--gap-ms", type=int_at_least(0), default=90)
    parser.add_argument(
        "--bare",
        action="store_true",
        help="also time the copies alone: each peer's piece read from its memory, the own "
        "piece copied, then a 4-byte freescale AllToAll",
    )
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.size % (4 * args.ranks):
        parser.error(f"--size must be a multiple of 4 x --ranks ({4 * args.ranks} B)")
    spec = GroupSpec(
        args.ranks, "freescale", init_timeout_s=120, setup="freescale_comm:register", threads=None
    )
    ranks = run_ranks_or_exit(spec, _rank, args, timeout_s=900)
    found = summary(ranks, args.calls)
    gap = f"{args.gap} {args.gap_ms} ms" if args.gap == "sleep" else args.gap
    print(f"AllToAll of {args.size} B, {args.ranks} ranks, gap before each block: {gap}")
    for name in ranks[0]:
        row = found[name]
        calls = " ".join(f"{t:.2f}" for t in row["per_call_ms"])
        print(f"  {name:9s} per call {calls} ms; block mean {row['block_mean_ms']:.2f} ms")
    print(f"  freescale / gloo, block means: {found['freescale_over_gloo']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": found, "ranks": ranks}, f, indent=1)


if __name__ == "__main__":
    main()
