"""``freescale train``: the baseline and FreeScale trained side by side on the same data."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from freescale_embed.train.config import (
    BASELINE,
    DATASETS,
    FREESCALE,
    MODES,
    POLICIES,
    RunConfig,
    TrainConfig,
    check_run,
)

_DEFAULTS = TrainConfig()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="freescale train",
        description=(
            "Trains a SASRec-style next-item model twice on the same data: the baseline (Gloo, "
            "no balancing, sync embeddings) and FreeScale (balancing, prioritized embeddings "
            "where each rank has a spare core, the freescale backend), and prints them side by "
            "side. Starts its own local ranks, or runs under torchrun. `freescale train report "
            "DIR` draws a finished run."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--dataset", choices=DATASETS, default=_DEFAULTS.dataset, help="training data")
    add("--world-size", type=int, default=_DEFAULTS.world_size, help="local ranks to start")
    add(
        "--device",
        choices=("cpu", "cuda"),
        default=_DEFAULTS.device,
        help="where the model computes (cuda: ranks take the GPUs round-robin)",
    )
    add("--steps", type=int, default=_DEFAULTS.steps, help="global steps per run (0: an epoch)")
    add("--batch-size", type=int, default=_DEFAULTS.global_batch_size, help="global batch")
    add("--max-history", type=int, default=_DEFAULTS.max_history, help="longest history")
    add("--users", type=int, default=_DEFAULTS.num_users, help="synthetic users")
    add("--items", type=int, default=_DEFAULTS.num_items, help="synthetic items")
    add("--negatives", type=int, default=_DEFAULTS.num_negatives, help="negatives per sample")
    add("--dim", type=int, default=_DEFAULTS.embedding_dim, help="model width")
    add("--layers", type=int, default=_DEFAULTS.num_layers, help="transformer blocks")
    add("--heads", type=int, default=_DEFAULTS.num_heads, help="attention heads")
    add("--lr", type=float, default=_DEFAULTS.lr, help="dense Adam learning rate")
    add("--embedding-lr", type=float, default=_DEFAULTS.embedding_lr, help="row-wise Adagrad lr")
    add("--seed", type=int, default=_DEFAULTS.seed, help="seed of the data and initial weights")
    add("--eval-users", type=int, default=_DEFAULTS.eval_users, help="users evaluated (0: all)")
    add("--threads", type=int, default=_DEFAULTS.threads, help="torch threads per rank")
    add("--deterministic", action="store_true", help="torch.use_deterministic_algorithms")
    add(
        "--min-balance-gain",
        type=float,
        default=_DEFAULTS.min_balance_gain,
        help="keep a batch unbalanced when balancing lowers the slowest rank's predicted "
        "compute by less than this fraction",
    )
    add(
        "--flop-cost-model",
        action="store_true",
        help="FBS/KK balance with the FLOP cost model throughout, not one fit to measured "
        "per-rank compute times",
    )
    add("--checkpoint-dir", default=None, help="save each run at its end; resume from it")
    add("--backend", default=FREESCALE.backend, help="FreeScale run's backend")
    add("--policy", choices=POLICIES, default=FREESCALE.policy, help="FreeScale run's balancing")
    add(
        "--mode",
        choices=MODES,
        default=FREESCALE.mode,
        help="its embeddings; auto: prioritized where every rank has a core to spare for its "
        "background thread, else sync (bitwise the same where balancing partitions alike)",
    )
    add(
        "--runs",
        default="baseline,freescale",
        help="runs, comma-separated: baseline, freescale, or backend:policy:mode",
    )
    add("--out", type=Path, default=Path("out/train"), help="where runs are written")
    return parser


def _runs(text: str, freescale: RunConfig) -> list[RunConfig]:
    runs = []
    for item in filter(None, text.split(",")):
        if item == "baseline":
            runs.append(BASELINE)
        elif item == "freescale":
            runs.append(freescale)
        else:
            parts = item.split(":")
            if len(parts) != 3:
                raise ValueError(
                    f"a run is baseline, freescale or backend:policy:mode, not {item!r}"
                )
            backend, policy, mode = parts
            runs.append(RunConfig(f"{backend}-{policy}-{mode}", backend, policy, mode))
    for run in runs:
        check_run(run)
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["report"]:
        return _report(args[1:])
    parsed = _parser().parse_args(args)
    try:
        config = TrainConfig(
            dataset=parsed.dataset,
            world_size=parsed.world_size,
            device=parsed.device,
            steps=parsed.steps or None,
            global_batch_size=parsed.batch_size,
            max_history=parsed.max_history,
            num_users=parsed.users,
            num_items=parsed.items,
            num_negatives=parsed.negatives,
            embedding_dim=parsed.dim,
            num_layers=parsed.layers,
            num_heads=parsed.heads,
            lr=parsed.lr,
            embedding_lr=parsed.embedding_lr,
            seed=parsed.seed,
            eval_users=parsed.eval_users or None,
            checkpoint_dir=parsed.checkpoint_dir,
            threads=parsed.threads,
            deterministic=parsed.deterministic,
            min_balance_gain=parsed.min_balance_gain,
            fit_cost_model=not parsed.flop_cost_model,
        )
        freescale = RunConfig("freescale", parsed.backend, parsed.policy, parsed.mode)
        runs = _runs(parsed.runs, freescale)
    except ValueError as error:
        print(f"freescale train: {error}", file=sys.stderr)
        return 2
    from freescale_embed.train.launch import run_training
    from freescale_embed.train.report import table

    try:
        summaries = run_training(config, runs, parsed.out)
    except (ImportError, FileNotFoundError, ValueError) as error:  # the data refused, or missing
        print(f"freescale train: {error}", file=sys.stderr)
        return 2
    if summaries is None:  # a rank other than 0 under torchrun
        return 0
    text = table(summaries)
    parsed.out.mkdir(parents=True, exist_ok=True)
    (parsed.out / "summary.json").write_text(json.dumps(summaries, indent=1) + "\n")
    (parsed.out / "table.txt").write_text(text + "\n")
    print(text)
    print(
        f"\nwritten: {parsed.out}/ (summary.json, table.txt, <run>/steps.jsonl); plots: "
        f"freescale train report {parsed.out}"
    )
    return 0


def _report(args: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="freescale train report",
        description="Draws a finished `freescale train` output folder into report.png.",
    )
    parser.add_argument("directory", type=Path, help="the --out folder of freescale train")
    parsed = parser.parse_args(args)
    from freescale_embed.train.report import plot

    try:
        path = plot(parsed.directory)
    except (FileNotFoundError, ImportError) as error:
        print(f"freescale train report: {error}", file=sys.stderr)
        return 2
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
