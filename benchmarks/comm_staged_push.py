"""How many device chunks a staging ring queues per progress call: the staged path's time per
AllToAll against ``shm.Channel.DEVICE_CHUNKS_PER_PUSH``, on two local ranks of one GPU.

Each value in ``--caps`` starts its own pair of ranks (``cuda_path="staged"``: the staging
rings), in the order given, so values alternate over the run. Per size: 3 warm-up calls, then
5 blocks of 6 back-to-back ``all_to_all_single`` calls ended by a synchronize; the figure is
the median block's time per call on each rank, and every output is checked. Writes
``staged_push.json`` and ``staged_push.png``.

    python benchmarks/comm_staged_push.py --out $OUT [--caps 64,2,1,64,2,1] [--sizes 64M,256M,8M]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from freescale_comm._freescale_args import byte_size_list, int_list
from freescale_comm._local_ranks import GroupSpec, run_ranks


def staged_pair() -> GroupSpec:
    """Two local CUDA ranks whose world group is freescale on the staged path (the rings)."""
    from freescale_comm import FreescaleOptions

    return GroupSpec(
        2,
        "freescale",
        setup="freescale_comm:register",
        threads=None,
        device="cuda",
        pg_options=FreescaleOptions(cuda_path="staged"),
    )


def _rank(cap: int, sizes: list[int]) -> dict[str, Any]:
    """One rank: ms per call by size, with the cap set before the first staged message."""
    import torch
    import torch.distributed as dist

    from freescale_comm import shm

    shm.Channel.DEVICE_CHUNKS_PER_PUSH = cap
    rows: dict[str, Any] = {}
    for nbytes in sizes:
        inp = torch.ones(nbytes // 4, device="cuda")
        out = torch.empty_like(inp)
        for _ in range(3):
            dist.all_to_all_single(out, inp)
        blocks = []
        for _ in range(5):
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(6):
                dist.all_to_all_single(out, inp)
            torch.cuda.synchronize()
            blocks.append((time.perf_counter() - start) / 6 * 1e3)
        rows[str(nbytes)] = {
            "ms_per_call": round(statistics.median(blocks), 3),
            "correct": bool((out == 1).all()),
        }
    return rows


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = report["sizes"]
    fig, axes = plt.subplots(1, len(sizes), figsize=(4 * len(sizes), 3.2))
    for ax, nbytes in zip(axes if len(sizes) > 1 else [axes], sizes, strict=True):
        for run, row in enumerate(report["runs"]):
            for rank, ranks in enumerate(row["ranks"]):
                ax.scatter(run, ranks[str(nbytes)]["ms_per_call"], c=f"C{rank}", s=18)
        ax.set_xticks(range(len(report["runs"])), [str(r["cap"]) for r in report["runs"]])
        ax.set_xlabel("chunks queued per progress call (run order)")
        ax.set_title(f"staged AllToAll, {nbytes >> 20} MiB per rank")
        ax.set_ylabel("ms per call (rank 0: blue, 1: orange)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "out"))
    parser.add_argument("--caps", type=int_list(), default="64,2,1,64,2,1")
    parser.add_argument("--sizes", type=byte_size_list(), default="64M,256M,8M")
    parser.add_argument("--plot", type=Path, help="only draw the figure of a saved JSON report")
    args = parser.parse_args()
    if args.plot is not None:
        _plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return 0
    sizes = list(args.sizes)
    report: dict[str, Any] = {"sizes": sizes, "runs": []}
    for cap in args.caps:
        ranks = run_ranks(staged_pair(), _rank, cap, sizes, timeout_s=100)
        report["runs"].append({"cap": cap, "ranks": ranks})
        print(f"cap {cap}: " + "  ".join(f"{k}: {v}" for k, v in enumerate(ranks)), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "staged_push.json").write_text(json.dumps(report, indent=1) + "\n")
    _plot(report, args.out / "staged_push.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
