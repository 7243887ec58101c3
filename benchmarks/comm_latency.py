"""Where one small freescale collective spends its time, CPU and CUDA tensors (2 local ranks).

Per ``all_to_all_single`` of 8 B, 64 KiB and 1 MiB (medians of 30 calls after 10 warm-ups,
rank 0), microseconds from the call to: ``started`` (headers posted), ``headers_out`` (CUDA data
folded into the headers has reached host memory and the headers left), ``_judge`` (every peer's
header arrived), ``_start_data``, ``_seal`` (CUDA: last copies queued), ``_finish`` and the call's
return — each single call after a barrier (so a peer's late start shows in ``_judge``) — and the
per-call time of 100 back-to-back calls. The ranks run on the one rank launcher
(``freescale_comm._local_ranks``). The marks wrap the collective's own methods: a diagnostic of
this code, not a comparison (``multi_gpu_vs_nccl.py`` compares with NCCL).

    python3 benchmarks/comm_latency.py --out $OUT [--cuda-path staged]   # one GPU or CPU only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

SIZES = (8, 64 << 10, 1 << 20)
MARKED = ("_judge", "_start_data", "_seal", "_start_ipc", "_finish")


def _mark(marks: dict[str, float]) -> None:
    """Wraps the collective's phase methods so that each records when it first ran."""
    from freescale_comm import collective

    cls = collective.Collective

    def wrap(name: str, label: str, when: str = "enter") -> None:
        """``when``: on entering the method, on leaving it, or on leaving it with a true result."""
        original = getattr(cls, name)

        def marked(self: Any, *args: Any, **kwargs: Any) -> Any:
            if when == "enter":
                marks.setdefault(label, time.perf_counter())
            result = original(self, *args, **kwargs)
            if when == "exit" or (when == "true" and result):
                marks.setdefault(label, time.perf_counter())
            return result

        setattr(cls, name, marked)

    for name in MARKED:
        wrap(name, name)
    wrap("_post_loaded_headers", "headers_out", "true")
    wrap("start", "started", "exit")
    try:  # the IPC path's own steps (CUDA machines)
        from freescale_comm import ipc
    except ImportError:
        return
    wrap("_post_headers", "headers_posted", "exit")
    for owner, name, label in (
        (ipc.Export, "__init__", "exported"),
        (ipc.IpcPath, "enqueue", "enqueued"),
    ):
        original = getattr(owner, name)

        def marked(self: Any, *args: Any, original: Any = original, label: str = label) -> Any:
            result = original(self, *args)
            marks.setdefault(label, time.perf_counter())
            return result

        setattr(owner, name, marked)


def _rank() -> dict[str, Any]:
    """In a rank of the launcher (its default group freescale): the figures of every size."""
    import torch
    import torch.distributed as dist

    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    marks: dict[str, float] = {}
    _mark(marks)
    results: dict[str, Any] = {}
    for device in devices:
        for nbytes in SIZES:
            inp = torch.ones(max(2, nbytes // 4 // 2 * 2), device=device)
            out = torch.empty_like(inp)
            rows = []
            for call in range(40):
                dist.barrier()
                if device == "cuda":
                    torch.cuda.synchronize()
                marks.clear()
                t0 = time.perf_counter()
                dist.all_to_all_single(out, inp)
                returned = time.perf_counter()
                if call >= 10:
                    rows.append(
                        {k: (v - t0) * 1e6 for k, v in marks.items()}
                        | {"returned": (returned - t0) * 1e6}
                    )
            keys = sorted(
                {k for row in rows for k in row},
                key=lambda k: statistics.median(row[k] for row in rows if k in row),
            )
            single = {k: round(statistics.median(r[k] for r in rows if k in r), 1) for k in keys}
            per_call = []
            for _ in range(5):
                dist.barrier()
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(100):
                    dist.all_to_all_single(out, inp)
                if device == "cuda":
                    torch.cuda.synchronize()
                per_call.append((time.perf_counter() - t0) / 100 * 1e6)
            results[f"{device} {nbytes} B"] = {
                "single_call_us": single,
                "back_to_back_us_per_call": round(statistics.median(per_call), 1),
            }
    return results


def main() -> int:
    """Measures on two local ranks, writes the JSON and prints a line per size; 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "out"))
    parser.add_argument(
        "--cuda-path",
        choices=("auto", "direct", "staged", "ipc"),
        default="auto",
        help="FreescaleOptions.cuda_path (staged: the staging rings between these local ranks)",
    )
    args = parser.parse_args()
    import torch

    from freescale_comm import FreescaleOptions
    from freescale_comm._local_ranks import GroupSpec, run_ranks

    spec = GroupSpec(
        2,
        "freescale",
        setup="freescale_comm:register",
        threads=None,
        device="cuda" if torch.cuda.is_available() else "cpu",
        pg_options=FreescaleOptions(cuda_path=args.cuda_path),
    )
    results = run_ranks(spec, _rank, timeout_s=240)[0]  # rank 0's marks
    args.out.mkdir(parents=True, exist_ok=True)
    name = (
        "comm_latency.json" if args.cuda_path == "auto" else f"comm_latency_{args.cuda_path}.json"
    )
    (args.out / name).write_text(json.dumps(results, indent=1) + "\n")
    for name, row in results.items():
        marks = "  ".join(f"{k}={v}" for k, v in row["single_call_us"].items())
        print(
            f"{name:>16}: back to back {row['back_to_back_us_per_call']} us/call; one call: {marks}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
