"""Where `freescale train`'s ranks read the GPU back: every synchronizing CUDA call, by thread
and call site, per step.

Each run spec (``--runs``) is trained alone on ``train_e2e.py``'s CUDA model (2 ranks sharing the
GPU) with torch's sync debug mode on in every rank; each rank counts the calls torch reports
(``torch.cuda.set_sync_debug_mode``: reads such as ``.item()``, ``.tolist()``, ``nonzero``,
pageable copies, stream synchronizations) by thread and innermost FreeScale frames, and divides
by the run's steps (the evaluation after them included, under its own call sites). Calls made
where no Python frame is (autograd's device thread, a backend's own threads) are printed by
torch, not counted. On a GPU shared by two processes each such call also waits for the other
process's queued kernels. Writes ``syncs.json`` and prints a table.

Usage::

    python3 benchmarks/train_e2e_syncs.py --out DIR [--runs freescale:none:sync,...]
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import os
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import TextIO

_COUNTS_DIR = "FREESCALE_SYNC_COUNTS"


def _count_syncs(directory: str) -> None:
    """In a rank: counts every sync warning by thread and call site, written at exit."""
    import torch

    counts: collections.Counter[str] = collections.Counter()
    shown = warnings.showwarning

    def record(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if "synchronizing" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        frames = [
            f"{Path(f.filename).name}:{f.lineno} {f.name}"
            for f in traceback.extract_stack()[:-1]
            if "freescale" in f.filename or "models" in f.filename
        ]
        thread = threading.current_thread().name.split("_")[0]
        counts[f"{thread} | {' < '.join(reversed(frames[-3:]))}"] += 1
        return None

    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")

    def write() -> None:
        Path(directory, f"{os.getpid()}.json").write_text(json.dumps(dict(counts)))

    atexit.register(write)


if __name__ != "__main__" and os.environ.get(_COUNTS_DIR):
    _count_syncs(os.environ[_COUNTS_DIR])  # a spawned rank (imported as ``__mp_main__``)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", default="freescale:none:sync,freescale:none:prioritized")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from train_e2e import CUDA_MODEL

    from freescale_embed.train import cli

    results = {}
    for run in args.runs.split(","):
        counts_dir = args.out / run.replace(":", "-")
        counts_dir.mkdir(parents=True, exist_ok=True)
        os.environ[_COUNTS_DIR] = str(counts_dir)
        argv_ = [*CUDA_MODEL, "--world-size", "2", "--steps", str(args.steps)]
        code = cli.main([*argv_, "--batch-size", "64", "--runs", run, "--out", str(counts_dir)])
        total: collections.Counter[str] = collections.Counter()
        for rank_file in counts_dir.glob("*.json"):
            if rank_file.stem.isdigit():
                total.update(json.loads(rank_file.read_text()))
        # Per rank and step (the ranks' calls summed, over the run's steps and its evaluation).
        per_step = {site: n / (2 * args.steps) for site, n in total.most_common()}
        results[run] = {"exit": code, "per_rank_step": per_step}
        print(f"== {run}: synchronizing calls per rank and step (exit {code}) ==")
        for site, n in per_step.items():
            print(f"{n:8.1f}  {site}")
    (args.out / "syncs.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
