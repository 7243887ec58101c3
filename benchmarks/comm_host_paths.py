"""Shared-memory rings against UCX for host bytes between ranks of one host (CPU tensors).

Two groups over the same local ranks, one with ``host_path="shm"`` and one with
``host_path="ucx"``, and a Gloo group; per size, blocks of back-to-back ``all_to_all_single`` /
``all_gather_into_tensor`` calls of the three alternate in the same processes (so that a load
that comes and goes hits all of them alike); the figure is the median over blocks of the slower
rank's time per call. ``auto``'s ``shm_max_bytes`` comes from where the rings stop winning.

    python benchmarks/comm_host_paths.py [--ranks 2] [--blocks 7] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from freescale_comm._local_ranks import GroupSpec, RankFailure, run_ranks


def _rank(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One rank on the launcher's Gloo group: every row (rank 0 prints them)."""
    import torch
    import torch.distributed as dist

    from freescale_comm import FreescaleOptions

    rank = dist.get_rank()
    timeout = timedelta(seconds=120)
    groups = {
        "shm": dist.new_group(
            backend="freescale", timeout=timeout, pg_options=FreescaleOptions(host_path="shm")
        ),
        "ucx": dist.new_group(
            backend="freescale", timeout=timeout, pg_options=FreescaleOptions(host_path="ucx")
        ),
        "gloo": None,
    }
    n = args.ranks
    rows = []
    size = args.min_bytes
    while size <= args.max_bytes:  # bytes per peer
        for op in ("all_to_all", "all_gather"):
            elements = max(1, size // 4)
            if op == "all_to_all":
                inp = torch.rand(n * elements)
                out = torch.empty(n * elements)

                def call(g: Any, out: torch.Tensor = out, inp: torch.Tensor = inp) -> None:
                    dist.all_to_all_single(out, inp, group=g)
            else:
                inp = torch.rand(elements)
                out = torch.empty(n * elements)

                def call(g: Any, out: torch.Tensor = out, inp: torch.Tensor = inp) -> None:
                    dist.all_gather_into_tensor(out, inp, group=g)

            for g in groups.values():
                for _ in range(3):
                    call(g)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(3):
                call(groups["ucx"])
            per = (time.perf_counter() - start) / 3
            t = torch.tensor([per])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            count = max(2, min(300, int(args.target_s / max(t.item(), 1e-6))))
            times: dict[str, list[float]] = {name: [] for name in groups}
            names = list(groups)
            for block in range(args.blocks):
                order = names[block % len(names) :] + names[: block % len(names)]
                for name in order:
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(count):
                        call(groups[name])
                    times[name].append((time.perf_counter() - start) / count)
            flat = torch.tensor([x for name in names for x in times[name]], dtype=torch.float64)
            dist.all_reduce(flat, op=dist.ReduceOp.MAX)
            slow = flat.tolist()
            row: dict[str, Any] = {"op": op, "bytes_per_peer": elements * 4, "calls": count}
            for k, name in enumerate(names):
                blocks = slow[k * args.blocks : (k + 1) * args.blocks]
                row[f"{name}_us"] = statistics.median(blocks) * 1e6
            rows.append(row)
            if rank == 0:
                print(
                    f"{op:<11}{elements * 4:>10} B/peer  shm {row['shm_us']:9.1f} us  "
                    f"ucx {row['ucx_us']:9.1f} us  gloo {row['gloo_us']:9.1f} us  "
                    f"shm/ucx {row['shm_us'] / row['ucx_us']:.2f}",
                    flush=True,
                )
        size *= args.factor
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--min-bytes", type=int, default=8)
    parser.add_argument("--max-bytes", type=int, default=16 << 20)
    parser.add_argument("--factor", type=int, default=4)
    parser.add_argument("--target-s", type=float, default=0.03)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    spec = GroupSpec(args.ranks, "gloo", init_timeout_s=120, setup="freescale_comm:register")
    try:
        rows = run_ranks(spec, _rank, args, timeout_s=900)[0]
    except RankFailure as failure:
        raise SystemExit(f"a rank failed: {failure}") from None
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "rows": rows,
            "load_avg_1m_at_end": os.getloadavg()[0],
        }
        (args.out / f"host_paths_{args.ranks}ranks.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
