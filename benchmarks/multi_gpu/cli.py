"""The command line and the run: phases within the budget, embed, summary, table, plots."""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from .context import describe_error
from .embed import run_embed
from .phases import retry_phase, run_phase
from .plots import draw_plots
from .report import format_table, summarize, write_json
from .settings import (
    FREESCALE,
    GIB,
    JSON_NAME,
    KIB,
    MIB,
    NCCL_FACTS,
    PHASE_MIN_S,
    PHASES,
    SAFE_ENV,
    SECTION_CAP,
    SRC_DIRS,
)
from .sizes import parse_size

DESCRIPTION = "Multi-GPU head-to-head of freescale_comm against NCCL, in one call."


def _parent_info() -> Any:
    try:
        from freescale_comm.info import collect

        return collect()
    except Exception as err:
        return {"error": describe_error(err)}


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark as the command line says; 0 (what went wrong is in the report)."""
    parser = argparse.ArgumentParser(prog="multi_gpu_vs_nccl", description=DESCRIPTION)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "out/multi_gpu"))
    parser.add_argument("--nprocs", type=int, default=2, help="ranks, one per GPU")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for everything")
    parser.add_argument("--min-bytes", type=parse_size, default=8)
    parser.add_argument("--max-bytes", type=parse_size, default=GIB)
    parser.add_argument("--factor", type=int, default=2, help="sweep step (2 = every power)")
    parser.add_argument(
        "--overlap-sizes",
        type=lambda s: [parse_size(x) for x in s.split(",")],
        default=[64 * MIB, 256 * MIB],
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--window-ms", type=float, default=60.0, help="compute window per measurement"
    )
    parser.add_argument(
        "--preroll-ms",
        type=float,
        default=8.0,
        help="GPU sleep queued before each window (outside it)",
    )
    parser.add_argument("--embed-steps", type=int, default=20)
    parser.add_argument("--group-timeout", type=float, default=60.0)
    parser.add_argument(
        "--sections",
        type=lambda s: s.split(","),
        default=list(SECTION_CAP),
        help="comma list of parts to run",
    )
    parser.add_argument(
        "--no-p2p-phase", action="store_true", help="skip the NCCL_P2P_USE_CUDA_MEMCPY=1 phase"
    )
    parser.add_argument("--no-attention", action="store_true")
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU tensors, Gloo standing in for NCCL, tiny sizes"
    )
    parser.add_argument(
        "--share-gpu",
        action="store_true",
        help="every rank on GPU 0 and no NCCL, which refuses that: the freescale parts checked "
        "on a one-GPU machine (its figures are not a multi-GPU rate)",
    )
    args = parser.parse_args(argv)
    t_start = time.time()
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.update(SAFE_ENV)
    for path in reversed(SRC_DIRS):
        if path.is_dir() and str(path) not in sys.path:
            sys.path.insert(0, str(path))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(p) for p in SRC_DIRS if p.is_dir()]
        + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]
    )
    args.cap_scale = 1.0
    if args.dry_run:
        args.max_bytes = min(args.max_bytes, 64 * KIB)
        args.factor = max(args.factor, 4)
        args.overlap_sizes = [64 * KIB]
        args.rounds = min(args.rounds, 2)
        args.window_ms = min(args.window_ms, 20.0)
        args.embed_steps = min(args.embed_steps, 3)
    deadline = t_start + args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "script": "benchmarks/multi_gpu_vs_nccl.py",
        "argv": sys.argv[1:] if argv is None else argv,
        "started_unix": t_start,
        "dry_run": args.dry_run,
        "nprocs": args.nprocs,
        "share_gpu": args.share_gpu,
        "budget_s": args.budget,
        "safe_env": SAFE_ENV,
        "json": str(args.out / JSON_NAME),
        "nccl_facts": NCCL_FACTS,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "phases": {},
    }
    report["info"] = _parent_info()
    if not args.dry_run:
        try:
            import torch

            report["cuda_device_count"] = torch.cuda.device_count()
            need = 1 if args.share_gpu else args.nprocs
            if torch.cuda.device_count() < need:
                report["error"] = (
                    f"{args.nprocs} ranks need {need} GPU(s), {torch.cuda.device_count()} seen"
                )
        except Exception as err:
            report["error"] = describe_error(err)
    write_json(args.out, report)
    phases = [p for p in PHASES if not (args.no_p2p_phase and p["name"] != "main")]
    if args.share_gpu:
        phases = [{**PHASES[0], "backends": list(FREESCALE)}]
    if "error" not in report:
        for index, phase in enumerate(phases):
            left = deadline - time.time()
            if left < PHASE_MIN_S and index > 0:
                report["phases"][phase["name"]] = {"skipped": f"time budget ({left:.0f} s left)"}
                continue
            # The main phase leaves room for the later ones, if it can.
            later = PHASE_MIN_S + 40 if index + 1 < len(phases) else 0
            phase_deadline = deadline - later if left > 2.5 * later else deadline
            run_phase(args, phase, phase_deadline, phase_deadline + 25, report)
            retry = retry_phase(phase, report["phases"][phase["name"]])
            if retry is not None and phase_deadline - time.time() > PHASE_MIN_S:
                run_phase(args, retry, phase_deadline, phase_deadline + 25, report)
            if index == 0 and "embed" in args.sections:
                t0 = time.time()
                end = min(
                    deadline - (PHASE_MIN_S if len(phases) > 1 else 0), t0 + SECTION_CAP["embed"]
                )
                try:
                    report["embed"] = run_embed(args, end)
                except Exception as err:
                    report["embed"] = {"status": "error", "error": describe_error(err)}
                report["embed"]["seconds"] = round(time.time() - t0, 1)
                write_json(args.out, report)
    report["summary"] = summarize(report)
    report["elapsed_s"] = round(time.time() - t_start, 1)
    write_json(args.out, report)
    report["plots"] = draw_plots(report, args.out)
    table = format_table(report)
    (args.out / "table.txt").write_text(table + "\n")
    write_json(args.out, report)
    print(table, flush=True)
    return 0
