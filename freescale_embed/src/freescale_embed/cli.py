"""``freescale embed ...`` subcommands."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from freescale_embed._freescale_args import (
    Parser,
    float_in,
    float_list,
    int_at_least,
    joined,
    print_written,
)
from freescale_embed.bench import BenchConfig, format_table, run_bench, write_report


def _parser() -> Parser:
    defaults = BenchConfig()
    parser = Parser(prog="freescale embed")
    commands = parser.add_subparsers(dest="command", required=True)
    what = "exposed embedding communication per step, sync vs prioritized, vs collision rate"
    bench = commands.add_parser("bench", help=what, description=what)
    bench.set_defaults(parser=bench)
    bench.add_argument(
        "--world-size", type=int_at_least(1), default=defaults.world_size, help="local ranks"
    )
    bench.add_argument(
        "--collision-rates",
        type=float_list(0.0, 1.0),
        default=joined(defaults.collision_rates),
        help="comma-separated shares of a step's rows that the previous step read",
    )
    bench.add_argument(
        "--steps", type=int_at_least(1), default=defaults.steps, help="timed steps per mode"
    )
    bench.add_argument(
        "--warmup", type=int_at_least(0), default=defaults.warmup, help="untimed steps first"
    )
    bench.add_argument(
        "--num-embeddings",
        type=int_at_least(1),
        default=defaults.num_embeddings,
        help="rows of the table (at least twice --rows-per-step)",
    )
    bench.add_argument(
        "--dim", type=int_at_least(1), default=defaults.embedding_dim, help="floats per row"
    )
    bench.add_argument(
        "--rows-per-step",
        type=int_at_least(1),
        default=defaults.rows_per_step,
        help="unique rows per step over all ranks",
    )
    bench.add_argument(
        "--batch-size", type=int_at_least(1), default=defaults.batch_size, help="samples per rank"
    )
    bench.add_argument(
        "--dense",
        choices=("sleep", "matmul", "gpu"),
        default=defaults.dense,
        help="simulated dense compute between forward and backward (gpu: bf16 matmuls, CUDA)",
    )
    bench.add_argument(
        "--dense-ms",
        type=float_in(0.0),
        default=defaults.dense_ms,
        help="length of a sleep or of the GPU matmuls",
    )
    bench.add_argument(
        "--matmul-size",
        type=int_at_least(1),
        default=defaults.matmul_size,
        help="side of the square matmuls (--dense matmul or gpu)",
    )
    bench.add_argument(
        "--matmul-repeats",
        type=int_at_least(1),
        default=defaults.matmul_repeats,
        help="matmuls per step (--dense matmul)",
    )
    bench.add_argument(
        "--optimizer-params",
        type=int_at_least(0),
        default=defaults.optimizer_params,
        help="dense parameters of an Adam step after each backward (0: none)",
    )
    bench.add_argument(
        "--threads", type=int_at_least(1), default=defaults.threads, help="threads per rank"
    )
    bench.add_argument("--seed", type=int, default=defaults.seed, help="workload seed")
    bench.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=defaults.device,
        help="where tables and batches live (cuda: rank r on GPU r %% device count)",
    )
    bench.add_argument(
        "--backend",
        choices=("gloo", "freescale", "nccl"),
        default=defaults.backend,
        help="process group backend (freescale needs freescale-comm, nccl --device cuda)",
    )
    bench.add_argument(
        "--out",
        type=Path,
        default=Path("out/embed_bench"),
        help="folder for embed_bench.json and embed_bench.png",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    refuse = args.parser.error
    if (args.dense == "gpu") != (args.device == "cuda"):
        refuse("--dense gpu goes with --device cuda (and a CUDA run needs --dense gpu)")
    if args.backend == "nccl" and args.device != "cuda":
        refuse("--backend nccl needs --device cuda")
    if args.backend == "freescale" and importlib.util.find_spec("freescale_comm") is None:
        refuse("--backend freescale needs freescale-comm: pip install './freescale_comm[cu12]'")
    try:
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
    except ValueError as error:
        refuse(str(error))
    report = run_bench(config, progress=True)
    print(format_table(report))
    written = write_report(report, args.out)
    print_written(written, "./freescale_embed[plot]")
    return 0 if all(point["exact"] for point in report["points"]) else 1
