"""``freescale comm ...`` subcommands: ``info`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().rstrip("ib").rstrip("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _world_sizes(text: str) -> list[int]:
    """``--world-sizes``: comma-separated rank counts, each at least 2."""
    try:
        sizes = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError(
            f"{text!r}: every world size must be at least 2 (a collective needs two ranks)"
        )
    return sizes


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freescale comm")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="UCX version and transports, GPUs, PCIe, NCCL")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.add_argument(
        "--ranks",
        type=_positive,
        default=0,
        help="also start this many local ranks and show the path of every pair",
    )
    info.add_argument(
        "--hosts",
        type=_positive,
        default=0,
        help="with --ranks: make the ranks look as if on this many hosts (FREESCALE_HOST_ID)",
    )
    bench = commands.add_parser(
        "bench", help="AllGather / AllToAll: freescale vs Gloo (CPU) or NCCL (CUDA)"
    )
    bench.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: freescale's direct and staged paths, NCCL where every rank "
        "has a GPU of its own",
    )
    bench.add_argument(
        "--world-sizes", type=_world_sizes, default="2", help="comma-separated, each >= 2, e.g. 2,4"
    )
    bench.add_argument("--min-bytes", type=_size, default="4K")
    bench.add_argument("--max-bytes", type=_size, default="64M", help="up to 1G")
    bench.add_argument("--factor", type=_positive, default=2)
    bench.add_argument("--ops", default="all_gather,all_to_all")
    bench.add_argument("--warmup", type=_positive, default=5, help="untimed calls per size")
    bench.add_argument(
        "--blocks",
        type=_positive,
        default=10,
        help="timed blocks per backend and size (median reported)",
    )
    bench.add_argument(
        "--target-s", type=float, default=0.05, help="time one block of calls aims at"
    )
    bench.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads per rank (0: torch's default, as in training)",
    )
    bench.add_argument("--out", type=Path, default=Path("out/comm_bench"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "info":
        from freescale_comm.info import collect, format_info

        info = collect()
        if args.ranks:
            from freescale_comm.info import local_paths

            info["paths"] = local_paths(args.ranks, args.hosts)
        print(json.dumps(info, indent=2) if args.json else format_info(info))
        return 0
    from freescale_comm.bench import BenchConfig, format_table, run_bench, write_report

    if args.max_bytes > 1 << 30:
        raise SystemExit("--max-bytes is limited to 1G")
    reports = []
    for world_size in args.world_sizes:
        config = BenchConfig(
            world_size=world_size,
            min_bytes=args.min_bytes,
            max_bytes=args.max_bytes,
            factor=args.factor,
            ops=tuple(op for op in args.ops.split(",") if op),
            warmup=args.warmup,
            blocks=args.blocks,
            target_s=args.target_s,
            device=args.device,
            threads=args.threads,
        )
        report = run_bench(config)
        reports.append(report)
        print(format_table(report))
        written = write_report(report, args.out)
        if len(written) == 1:
            print("matplotlib is not installed: no plot (pip install 'freescale-comm[plot]')")
        print("wrote " + ", ".join(str(p) for p in written))
    combined = args.out / "comm_bench.json"
    command = "freescale comm " + " ".join(argv if argv is not None else sys.argv[2:])
    combined.write_text(json.dumps({"command": command, "reports": reports}, indent=2))
    print(f"wrote {combined} (every world size)")
    return 0
