"""How the first calls of a block compare with the later ones: freescale's and Gloo's
``all_to_all_single`` on CPU tensors, each call of a block timed alone.

Local ranks run blocks of ``--calls`` back-to-back calls of one backend, after a gap of the
kind ``--gap`` names: ``none`` (the same backend's previous block, a barrier between: calls
back to back), ``sleep`` (``--gap-ms`` asleep after the barrier) or ``other`` (the other
backend's block, as ``freescale comm bench`` alternates them). Per backend and position in the
block: the median over blocks of the slowest rank's time of that call, and the block's mean,
which is what a bench block of that many calls reports. Outputs are reused from call to call,
as in the bench.

    python benchmarks/comm_first_calls.py [--ranks 4] [--size 32M] [--calls 7] [--blocks 8]
        [--gap none|sleep|other] [--gap-ms 90] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from freescale_comm._freescale_args import Parser, byte_size, int_at_least
from freescale_comm._local_ranks import GroupSpec, run_ranks_or_exit

BACKENDS = ("freescale", "gloo")
WARMUP_CALLS = 5


def _rank(args: argparse.Namespace) -> dict[str, list[list[float]]]:
    """Per backend, per block, each call's time (seconds) on this rank."""
    import torch
    import torch.distributed as dist

    gloo = dist.new_group(backend="gloo")
    groups = {"freescale": None, "gloo": gloo}
    inp = torch.rand(args.size // 4)
    outputs = {name: torch.empty_like(inp) for name in BACKENDS}
    for name in BACKENDS:
        for _ in range(WARMUP_CALLS):
            dist.all_to_all_single(outputs[name], inp, group=groups[name])
    times: dict[str, list[list[float]]] = {name: [] for name in BACKENDS}
    order = [name for block in range(args.blocks) for name in BACKENDS[:: 1 - 2 * (block % 2)]]
    if args.gap != "other":  # each backend's blocks together, so that none follows the other
        order = sorted(order, key=BACKENDS.index)
    for name in order:
        dist.barrier(group=gloo)
        if args.gap == "sleep":
            time.sleep(args.gap_ms / 1e3)
        block = []
        for _ in range(args.calls):
            start = time.perf_counter()
            dist.all_to_all_single(outputs[name], inp, group=groups[name])
            block.append(time.perf_counter() - start)
        times[name].append(block)
    return times


def summary(ranks: list[dict[str, list[list[float]]]], calls: int) -> dict[str, Any]:
    """Per backend, the median over blocks of the slowest rank's time of each call position
    (ms) and the block mean; the ratio of freescale's block mean to Gloo's."""
    found: dict[str, Any] = {}
    for name in BACKENDS:
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
    for name in BACKENDS:
        row = found[name]
        calls = " ".join(f"{t:.2f}" for t in row["per_call_ms"])
        print(f"  {name:9s} per call {calls} ms; block mean {row['block_mean_ms']:.2f} ms")
    print(f"  freescale / gloo, block means: {found['freescale_over_gloo']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": found, "ranks": ranks}, f, indent=1)


if __name__ == "__main__":
    main()
