"""The host paths of CPU bytes between ranks of one host, against each other and Gloo.

One freescale group per ``--paths`` entry over the same local ranks, and a Gloo group; per size,
blocks of back-to-back ``all_to_all_single`` / ``all_gather_into_tensor`` calls of each alternate
in the same processes (so that a load that comes and goes hits all of them alike); the figure is
the median over blocks of the slower rank's time per call. The paths: ``shm`` (every message
through the shared-memory rings: two copies through slots that stay in cache), ``reads``
(``auto`` with every message read from the sender's memory: one copy, the sender's pages pinned
by the kernel) and ``ucx`` (UCX: shared memory, then cross-memory attach); ``auto`` is the
default, which switches from the rings to reads above ``shm_max_bytes``.

    python benchmarks/comm_host_paths.py [--ranks 2] [--paths shm,reads] [--blocks 7] [--out DIR]
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

from freescale_comm import FreescaleOptions
from freescale_comm._freescale_args import byte_size
from freescale_comm._local_ranks import GroupSpec, run_ranks_or_exit
from freescale_comm.bench import dist_all_gather_into_tensor
from freescale_comm.info import page_settings


def _rank(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One rank on the launcher's Gloo group: every row (rank 0 prints them)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    gather = dist_all_gather_into_tensor()
    timeout = timedelta(seconds=120)
    groups: dict[str, Any] = {
        name: dist.new_group(
            backend="freescale", timeout=timeout, pg_options=FreescaleOptions(**PATHS[name])
        )
        for name in args.paths
    }
    groups["gloo"] = None
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
                    gather(out, inp, group=g)

            for g in groups.values():
                for _ in range(3):
                    call(g)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(3):
                call(groups[args.paths[0]])
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
                cells = "  ".join(f"{name} {row[f'{name}_us']:9.1f} us" for name in names)
                first = row[f"{names[0]}_us"]
                ratios = "  ".join(
                    f"{name}/{names[0]} {row[f'{name}_us'] / first:.2f}" for name in names[1:]
                )
                print(f"{op:<11}{elements * 4:>10} B/peer  {cells}  {ratios}", flush=True)
        size *= args.factor
    return rows


# Each path as the options of its group.
PATHS: dict[str, dict[str, Any]] = {
    "shm": {"host_path": "shm"},
    "reads": {"host_path": "auto", "shm_max_bytes": 0},
    "auto": {"host_path": "auto"},
    "ucx": {"host_path": "ucx"},
}


def _path_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(PATHS))
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"paths are distinct names out of {sorted(PATHS)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--paths", type=_path_names, default=["shm", "reads"])
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--min-bytes", type=byte_size, default=8, help="per peer, e.g. 256K")
    parser.add_argument("--max-bytes", type=byte_size, default=16 << 20)
    parser.add_argument("--factor", type=int, default=4)
    parser.add_argument("--target-s", type=float, default=0.03)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    spec = GroupSpec(args.ranks, "gloo", init_timeout_s=120, setup="freescale_comm:register")
    rows = run_ranks_or_exit(spec, _rank, args, timeout_s=900)[0]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {
            "args": {k: str(v) for k, v in vars(args).items()},
            **page_settings(),
            "rows": rows,
            "load_avg_1m_at_end": os.getloadavg()[0],
        }
        (args.out / f"host_paths_{args.ranks}ranks.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
