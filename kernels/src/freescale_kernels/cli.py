"""``freescale kernels ...`` subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from freescale_kernels._freescale_args import (
    Parser,
    int_at_least,
    int_list,
    joined,
    name_list,
    print_written,
)
from freescale_kernels.bench import (
    OPS,
    PROVIDERS,
    BenchConfig,
    format_table,
    headline,
    run,
    write_report,
)
from freescale_kernels.tiles import TUNED, CopyTile, SumTile

T = TypeVar("T", CopyTile, SumTile)


def _defaults(name: str) -> str:
    """``name``'s default and its ``--quick`` value, as ``--help`` shows them."""
    full, quick = getattr(BenchConfig(), name), getattr(BenchConfig.quick(), name)
    show = joined if isinstance(full, tuple) else str
    if full == quick:
        return f"(default: {show(full)})"
    return f"(default: {show(full)}; with --quick: {show(quick)})"


def _tile(kind: type[T], counts: tuple[int, ...], shape: str) -> Callable[[str], T]:
    """A tile option: ``counts`` comma-separated positive integers (``shape`` names them)."""
    parse_list = int_list(1)

    def parse(text: str) -> T:
        values = parse_list(text)
        if len(values) not in counts:
            raise argparse.ArgumentTypeError(f"{text!r} is not {shape}")
        try:
            return kind(*values)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def _parser() -> Parser:
    parser = Parser(prog="freescale kernels")
    commands = parser.add_subparsers(dest="command", required=True)
    what = "latency of Triton vs vectorized eager vs naive per-rank loops over world sizes"
    bench = commands.add_parser("bench", help=what, description=what)
    bench.add_argument(
        "--quick", action="store_true", help="small sizes that run in seconds (CPU smoke test)"
    )
    bench.add_argument(
        "--check", action="store_true", help="verify triton == reference on the inputs first"
    )
    sized = {
        "--world-sizes": (int_list(1), "world_sizes", "comma-separated world sizes"),
        "--local-batch": (int_at_least(1), "local_batch", "samples per rank"),
        "--large-batch": (
            int_at_least(0),
            "large_batch",
            "samples per rank of the large cases (0: none)",
        ),
        "--large-world-sizes": (int_list(1), "large_world_sizes", "world sizes of the large cases"),
        "--num-keys": (int_at_least(1), "num_keys", "keys (features) per sample"),
        "--max-length": (int_at_least(1), "max_length", "longest run of a sample in a key"),
        "--embedding-dim": (int_at_least(1), "embedding_dim", "row width of the rows cases"),
        "--rep-ms": (int_at_least(1), "rep_ms", "timing budget per measurement, ms"),
        "--seed": (int, "seed", "seed of the inputs"),
    }
    for option, (kind, name, meaning) in sized.items():
        bench.add_argument(option, type=kind, help=f"{meaning} {_defaults(name)}")
    bench.add_argument(
        "--ops", type=name_list(OPS), help=f"comma-separated subset of {joined(OPS)} (default: all)"
    )
    bench.add_argument(
        "--providers",
        type=name_list(PROVIDERS),
        help=f"comma-separated subset of {joined(PROVIDERS)} (default: all)",
    )
    bench.add_argument(
        "--device", choices=("cuda", "cpu"), help="where to measure (default: cuda when available)"
    )
    bench.add_argument(
        "--no-graphs",
        dest="graphs",
        action="store_false",
        default=None,
        help="skip the CUDA-graph GPU times, host times and plan / copy split",
    )
    bench.add_argument(
        "--profile", action="store_true", default=None, help="torch.profiler summary per op"
    )
    bench.add_argument(
        "--copy-tile",
        type=_tile(CopyTile, (3, 4), "bytes,max_rows,warps[,search_lanes]"),
        help="copy kernel tile: bytes,max_rows,warps[,search_lanes] (default: the tuned one)",
    )
    bench.add_argument(
        "--sum-tile",
        type=_tile(SumTile, (2,), "elements,warps"),
        help="segment-sum tile: elements,warps (default: the tuned one)",
    )
    bench.add_argument(
        "--out",
        type=Path,
        default=Path("out/kernels_bench"),
        help="folder for kernels_bench.json and one <op>.png per operation",
    )
    what = "redraw the table and plots of a kernels_bench.json (e.g. from a GPU run)"
    plot = commands.add_parser("plot", help=what, description=what)
    plot.set_defaults(parser=plot)
    plot.add_argument("json", type=Path, help="a kernels_bench.json written by bench")
    plot.add_argument("--out", type=Path, help="folder for the plots (default: next to the JSON)")
    return parser


def _read_report(args: argparse.Namespace) -> dict:
    """The report in ``args.json``; a missing or unreadable file is refused in one line."""
    try:
        report = json.loads(args.json.read_text())
    except OSError as error:
        args.parser.error(f"cannot read {args.json}: {error.strerror or error}")
    except ValueError as error:
        args.parser.error(f"{args.json} is not JSON: {error}")
    if not isinstance(report, dict) or not {"meta", "results"} <= set(report):
        args.parser.error(f"{args.json} is not a kernels_bench.json (no meta and results)")
    return report


def _config(args: argparse.Namespace) -> BenchConfig:
    overrides = {
        name: getattr(args, name)
        for name in (
            "world_sizes",
            "local_batch",
            "large_batch",
            "large_world_sizes",
            "graphs",
            "profile",
            "num_keys",
            "max_length",
            "embedding_dim",
            "ops",
            "providers",
            "device",
            "rep_ms",
            "seed",
        )
        if getattr(args, name) is not None
    }
    overrides["check"] = args.check
    tiles = TUNED
    if args.copy_tile:
        tiles = replace(tiles, copy=args.copy_tile)
    if args.sum_tile:
        tiles = replace(tiles, segment_sum=args.sum_tile)
    overrides["tiles"] = tiles
    return BenchConfig.quick(**overrides) if args.quick else BenchConfig(**overrides)


def _show(report: dict, out: Path) -> None:
    """Prints the table and headline of ``report`` and writes its JSON and plots to ``out``."""
    print("\n".join([format_table(report), *headline(report)]))
    print_written(write_report(report, out), "./kernels[plot]")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "plot":
        _show(_read_report(args), args.out or args.json.parent)
        return 0
    report = run(_config(args), progress=True)
    _show(report, args.out)
    failed_checks = [
        r for r in report["results"] if str(r.get("check", "")).startswith(("FAIL", "error"))
    ]
    if failed_checks:
        print(f"{len(failed_checks)} correctness check(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
