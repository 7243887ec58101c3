"""CUDA AllToAll / AllGather in a group that spans hosts: each path of freescale_comm side by side.

Four local ranks made to look as if on two hosts (``FREESCALE_HOST_ID``: ranks 0-1 and 2-3),
every group on the rank's one GPU (rank r uses GPU r % device count). Per collective, per-rank
size and path, the slowest rank's time per call, median over blocks of calls, the paths' blocks
alternated in one run:

- ``auto``: CUDA IPC between the two ranks of a host, UCX device messages between hosts, in
  the same collective (the default);
- ``direct``: UCX device messages between every pair (what ``auto`` took in a group spanning
  hosts before IPC was chosen per peer), AllGather by its ``auto`` algorithm (the ring from
  ``ring_threshold_bytes``); ``direct_ag_direct`` the same with the direct AllGather algorithm,
  which ``auto`` now takes for CUDA tensors (this separates the algorithm from IPC);
- ``staged``: the staging rings within a host, the staged pipeline over UCX between hosts.

Every result is checked against the values each rank can compute. NCCL is not beside them: it
refuses two ranks on one GPU (``multi_gpu_vs_nccl.py`` is the head-to-head where GPUs allow).
Writes ``comm_two_hosts.json`` and ``comm_two_hosts.png`` under ``--out``:

    python3 benchmarks/comm_two_hosts.py --out $OUT [--blocks 5]
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

# name: FreescaleOptions fields
PATHS = {
    "auto": {"cuda_path": "auto"},
    "direct": {"cuda_path": "direct"},
    "direct_ag_direct": {"cuda_path": "direct", "allgather": "direct"},
    "staged": {"cuda_path": "staged"},
}
SIZES = (64 << 10, 4 << 20, 64 << 20, 256 << 20)  # bytes per rank (input of AllToAll)
RANKS, HOSTS = 4, 2


def _calls_for(nbytes: int) -> int:
    return 10 if nbytes <= 4 << 20 else 3


def _rank(blocks: int) -> dict[str, Any]:
    """In a rank of the launcher: every (op, size, path) row (rank 0's report is kept)."""
    import torch
    import torch.distributed as dist

    from freescale_comm import FreescaleOptions

    rank, n = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    groups = {}
    os.environ["FREESCALE_HOST_ID"] = f"bench-host-{rank * HOSTS // n}"
    try:
        for path, fields in PATHS.items():
            groups[path] = dist.new_group(
                backend="freescale",
                timeout=timedelta(seconds=120),
                pg_options=FreescaleOptions(**fields),
            )
    finally:
        del os.environ["FREESCALE_HOST_ID"]
    cuda_paths = {
        path: sorted({r["cuda"].split(":")[0] for r in g.paths()}) for path, g in groups.items()
    }
    rows = []
    for op in ("all_to_all_single", "all_gather_into_tensor"):
        for nbytes in SIZES:
            elements = nbytes // 4 // n * n
            inp = torch.arange(elements, dtype=torch.int32, device=dev) + rank * elements
            if op == "all_to_all_single":
                out = torch.empty_like(inp)
                per = elements // n
                want = torch.cat(
                    [torch.arange(per, device=dev) + r * elements + rank * per for r in range(n)]
                ).int()

                def call(g: Any, out: Any = out, inp: Any = inp) -> None:
                    dist.all_to_all_single(out, inp, group=g)

            else:
                out = torch.empty(n * elements, dtype=torch.int32, device=dev)
                want = torch.arange(n * elements, dtype=torch.int32, device=dev)

                def call(g: Any, out: Any = out, inp: Any = inp) -> None:
                    dist.all_gather_into_tensor(out, inp, group=g)

            calls = _calls_for(nbytes)
            times: dict[str, list[float]] = {path: [] for path in PATHS}
            correct = {}
            for path in PATHS:  # warm-up (maps, mailboxes, pools), then one checked result
                for _ in range(2):
                    call(groups[path])
                out.zero_()
                call(groups[path])
                torch.cuda.synchronize()
                ok = torch.tensor([float(torch.equal(out, want))])
                dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=gloo)
                correct[path] = bool(ok.item())
            for block in range(blocks):
                names = list(PATHS)
                order = names[block % len(names) :] + names[: block % len(names)]
                for path in order:
                    torch.cuda.synchronize()
                    dist.barrier(group=gloo)
                    start = time.perf_counter()
                    for _ in range(calls):
                        call(groups[path])
                    torch.cuda.synchronize()
                    t = torch.tensor([(time.perf_counter() - start) / calls], dtype=torch.float64)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
                    times[path].append(float(t.item()))
            moved = nbytes if op == "all_to_all_single" else n * nbytes
            for path in PATHS:
                median = statistics.median(times[path])
                rows.append(
                    {
                        "op": op,
                        "bytes_per_rank": nbytes,
                        "path": path,
                        "correct": correct[path],
                        "ms_per_call": round(median * 1e3, 4),
                        "busbw_gbps": round(moved * (n - 1) / n / median / 1e9, 2),
                        "blocks_ms": [round(x * 1e3, 4) for x in times[path]],
                    }
                )
    for g in groups.values():
        dist.destroy_process_group(g)
    return {
        "rows": rows,
        "cuda_paths_of_peers": cuda_paths,
        "calls_per_block": "10 <= 4 MiB, else 3",
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, op in zip(axes, ("all_to_all_single", "all_gather_into_tensor"), strict=True):
        for name in PATHS:
            rows = [r for r in report["rows"] if r["op"] == op and r["path"] == name]
            ax.plot(
                [r["bytes_per_rank"] / (1 << 20) for r in rows],
                [r["busbw_gbps"] for r in rows],
                marker="o",
                label=name,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("MiB per rank")
        ax.set_ylabel("busbw GB/s (slowest rank, median)")
        ax.set_title(f"{op}: 4 ranks, 2 pretend hosts, 1 H200")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "out"))
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--plot", type=Path, help="only draw the figure of a saved JSON report")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return 0
    from freescale_comm._local_ranks import GroupSpec, run_ranks
    from freescale_comm.info import collect

    spec = GroupSpec(
        RANKS, "freescale", setup="freescale_comm:register", threads=None, device="cuda"
    )
    report = {"info": collect()} | run_ranks(spec, _rank, args.blocks, timeout_s=args.timeout)[0]
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / "comm_two_hosts.json"
    target.write_text(json.dumps(report, indent=1, default=str) + "\n")
    try:
        plot(report, target.with_suffix(".png"))
    except ImportError as err:  # no matplotlib on the GPU machine: --plot later
        print(f"no plot: {err}")
    for row in report["rows"]:
        print(
            f"{row['op']:>22} {row['bytes_per_rank'] >> 10:>8} KiB {row['path']:>16}: "
            f"{row['ms_per_call']:9.3f} ms {row['busbw_gbps']:8.2f} GB/s"
            f"{'' if row['correct'] else '  WRONG'}"
        )
    print(report["cuda_paths_of_peers"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
