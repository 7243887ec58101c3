"""``freescale embed ...`` subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from freescale_embed.bench import BenchConfig, format_table, run_bench, write_report


def _float_list(text: str) -> tuple[float, ...]:
    return tuple(float(item) for item in text.split(",") if item)


def _parser() -> argparse.ArgumentParser:
    defaults = BenchConfig()
    parser = argparse.ArgumentParser(prog="freescale embed")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser(
        "bench",
        help="exposed embedding communication per step, sync vs prioritized, vs collision rate",
    )
    bench.add_argument("--world-size", type=int, default=defaults.world_size)
    bench.add_argument(
        "--collision-rates",
        type=_float_list,
        default=defaults.collision_rates,
        help="comma-separated shares of a step's rows that the previous step read",
    )
    bench.add_argument("--steps", type=int, default=defaults.steps, help="timed steps")
    bench.add_argument("--warmup", type=int, default=defaults.warmup)
    bench.add_argument("--num-embeddings", type=int, default=defaults.num_embeddings)
    bench.add_argument("--dim", type=int, default=defaults.embedding_dim)
    bench.add_argument(
        "--rows-per-step",
        type=int,
        default=defaults.rows_per_step,
        help="unique rows per step over all ranks",
    )
    bench.add_argument("--batch-size", type=int, default=defaults.batch_size)
    bench.add_argument(
        "--dense",
        choices=("sleep", "matmul", "gpu"),
        default=defaults.dense,
        help="simulated dense compute between forward and backward (gpu: bf16 matmuls, CUDA)",
    )
    bench.add_argument(
        "--dense-ms", type=float, default=defaults.dense_ms, help="length of a sleep or GPU matmuls"
    )
    bench.add_argument("--matmul-size", type=int, default=defaults.matmul_size)
    bench.add_argument("--matmul-repeats", type=int, default=defaults.matmul_repeats)
    bench.add_argument(
        "--optimizer-params",
        type=int,
        default=defaults.optimizer_params,
        help="dense parameters of an Adam step after each backward (0: none)",
    )
    bench.add_argument("--threads", type=int, default=defaults.threads, help="threads per rank")
    bench.add_argument("--seed", type=int, default=defaults.seed)
    bench.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=defaults.device,
        help="where tables and batches live (cuda: rank r on GPU r %% device count)",
    )
    bench.add_argument(
        "--backend",
        default=defaults.backend,
        help="process group backend: gloo, freescale (needs freescale-comm) or nccl",
    )
    bench.add_argument(
        "--out",
        type=Path,
        default=Path("out/embed_bench"),
        help="folder for embed_bench.json and embed_bench.png",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if (args.dense == "gpu") != (args.device == "cuda"):
        parser.error("--dense gpu goes with --device cuda (and a CUDA run needs --dense gpu)")
    config = BenchConfig(
        world_size=args.world_size,
        collision_rates=args.collision_rates,
        steps=args.steps,
        warmup=args.warmup,
        num_embeddings=args.num_embeddings,
        embedding_dim=args.dim,
        rows_per_step=args.rows_per_step,
        batch_size=args.batch_size,
        dense=args.dense,
        dense_ms=args.dense_ms,
        matmul_size=args.matmul_size,
        matmul_repeats=args.matmul_repeats,
        optimizer_params=args.optimizer_params,
        threads=args.threads,
        seed=args.seed,
        device=args.device,
        backend=args.backend,
    )
    report = run_bench(config)
    print(format_table(report))
    written = write_report(report, args.out)
    if len(written) == 1:
        print("matplotlib is not installed: no plot (pip install 'freescale-embed[plot]')")
    print("wrote " + ", ".join(str(p) for p in written))
    return 0 if all(point["exact"] for point in report["points"]) else 1
