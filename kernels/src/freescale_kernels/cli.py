"""``freescale kernels ...`` subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from freescale_kernels.bench import (
    OPS,
    PROVIDERS,
    BenchConfig,
    format_table,
    headline,
    run,
    write_report,
)


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(item) for item in text.split(",") if item)


def _name_list(choices: Sequence[str]) -> argparse.FileType:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(item for item in text.split(",") if item)
        unknown = sorted(set(names) - set(choices))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {list(choices)}")
        return names

    return parse  # type: ignore[return-value]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freescale kernels")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser(
        "bench",
        help="latency of Triton vs vectorized eager vs naive per-rank loops over world sizes",
    )
    bench.add_argument(
        "--quick", action="store_true", help="small sizes that run in seconds (CPU smoke test)"
    )
    bench.add_argument(
        "--check", action="store_true", help="verify triton == reference on the inputs first"
    )
    bench.add_argument("--world-sizes", type=_int_list, help="comma-separated, e.g. 8,32,128,512")
    bench.add_argument("--local-batch", type=int, help="samples per rank")
    bench.add_argument(
        "--large-batch", type=int, help="samples per rank of the large cases (0: none)"
    )
    bench.add_argument(
        "--large-world-sizes", type=_int_list, help="world sizes of the large cases, e.g. 8,512"
    )
    bench.add_argument("--num-keys", type=int, help="keys (features) per sample")
    bench.add_argument("--max-length", type=int, help="longest run of a sample in a key")
    bench.add_argument("--embedding-dim", type=int, help="row width of the rows case")
    bench.add_argument("--ops", type=_name_list(OPS), help=f"subset of {','.join(OPS)}")
    bench.add_argument(
        "--providers", type=_name_list(PROVIDERS), help=f"subset of {','.join(PROVIDERS)}"
    )
    bench.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    bench.add_argument("--rep-ms", type=int, help="timing budget per measurement")
    bench.add_argument("--seed", type=int)
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
        type=_int_list,
        help="override the copy tile: bytes,max_rows,warps (see ops/jagged_copy.py)",
    )
    bench.add_argument(
        "--sum-tile", type=_int_list, help="override the segment-sum tile: elements,warps"
    )
    bench.add_argument(
        "--out",
        type=Path,
        default=Path("out/kernels_bench"),
        help="folder for kernels_bench.json and one <op>.png per operation",
    )
    plot = commands.add_parser(
        "plot", help="redraw the table and plots of a kernels_bench.json (e.g. from a GPU run)"
    )
    plot.add_argument("json", type=Path, help="a kernels_bench.json written by bench")
    plot.add_argument("--out", type=Path, help="folder for the plots (default: next to the JSON)")
    return parser


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
    return BenchConfig.quick(**overrides) if args.quick else BenchConfig(**overrides)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "plot":
        report = json.loads(args.json.read_text())
        print("\n".join([format_table(report), *headline(report)]))
        written = write_report(report, args.out or args.json.parent)
        if len(written) == 1:
            print("matplotlib is not installed: no plots (pip install 'freescale-kernels[plot]')")
        print("wrote " + ", ".join(str(p) for p in written))
        return 0
    if args.copy_tile or args.sum_tile:
        from freescale_kernels.tune import set_copy_tile, set_sum_tile

        if args.copy_tile:
            set_copy_tile(*args.copy_tile)
        if args.sum_tile:
            set_sum_tile(*args.sum_tile)
    report = run(_config(args))
    print("\n".join([format_table(report), *headline(report)]))
    written = write_report(report, args.out)
    if len(written) == 1:
        print("matplotlib is not installed: no plots (pip install 'freescale-kernels[plot]')")
    print("wrote " + ", ".join(str(p) for p in written))
    failed_checks = [
        r for r in report["results"] if str(r.get("check", "")).startswith(("FAIL", "error"))
    ]
    if failed_checks:
        print(f"{len(failed_checks)} correctness check(s) failed", file=sys.stderr)
        return 1
    return 0
