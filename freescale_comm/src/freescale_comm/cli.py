"""``freescale comm ...`` subcommands: ``info`` and ``bench``."""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from freescale_comm._freescale_args import (
    Parser,
    byte_size,
    float_in,
    int_at_least,
    int_list,
    name_list,
    print_written,
)

# The collectives freescale comm bench measures (freescale_comm.bench.OPS; not imported here so
# that --help does not import torch).
_OPS = ("all_gather", "all_to_all")


def _parser() -> Parser:
    parser = Parser(prog="freescale comm")
    commands = parser.add_subparsers(dest="command", required=True)
    what = "UCX version and transports, GPUs, PCIe, NCCL"
    info = commands.add_parser("info", help=what, description=what)
    info.set_defaults(parser=info)
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.add_argument(
        "--ranks",
        type=int_at_least(0),
        default=0,
        help="also start this many local ranks (at least 2) and show the path of every pair "
        "(0: none)",
    )
    info.add_argument(
        "--hosts",
        type=int_at_least(0),
        default=0,
        help="with --ranks: make the ranks look as if on this many hosts (FREESCALE_HOST_ID; "
        "0: on this host, as they are)",
    )
    what = "AllGather / AllToAll: freescale vs Gloo (CPU) or NCCL (CUDA)"
    bench = commands.add_parser("bench", help=what, description=what)
    bench.set_defaults(parser=bench)
    bench.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: freescale's IPC, direct and staged paths, NCCL where every rank "
        "has a GPU of its own",
    )
    bench.add_argument(
        "--world-sizes",
        type=int_list(2),
        default="2",
        help="comma-separated local rank counts, each >= 2, e.g. 2,4",
    )
    bench.add_argument(
        "--min-bytes",
        type=byte_size,
        default="4K",
        help="smallest size: bytes one rank receives, in whole float32s per rank (at least one "
        "each; the table shows the size measured, and sizes that round to one are measured once)",
    )
    bench.add_argument("--max-bytes", type=byte_size, default="64M", help="largest size, up to 1G")
    bench.add_argument(
        "--factor", type=int_at_least(2), default=2, help="ratio between consecutive sizes"
    )
    bench.add_argument(
        "--ops",
        type=name_list(_OPS),
        default=",".join(_OPS),
        help="comma-separated collectives to measure",
    )
    bench.add_argument(
        "--warmup",
        type=int_at_least(1),
        default=5,
        help="untimed calls per backend and size (the first one's result is checked)",
    )
    bench.add_argument(
        "--blocks",
        type=int_at_least(1),
        default=10,
        help="timed blocks per backend and size (median reported)",
    )
    bench.add_argument(
        "--target-s",
        type=float_in(0.0, open_low=True),
        default=0.05,
        help="seconds one block of calls aims at (sets the calls per block)",
    )
    bench.add_argument(
        "--min-calls",
        type=int_at_least(1),
        default=20,
        help="calls per block at the least, however long they take (at most 500)",
    )
    bench.add_argument(
        "--threads",
        type=int_at_least(0),
        default=0,
        help="torch intra-op threads per rank (0: torch's default, as in training)",
    )
    bench.add_argument(
        "--huge-pages",
        action="store_true",
        help="ranks' torch asks for transparent huge pages for its CPU tensors of 2 MiB and "
        "more (THP_MEM_ALLOC_ENABLE=1, both backends; 0 without the flag)",
    )
    bench.add_argument(
        "--out",
        type=Path,
        default=Path("out/comm_bench"),
        help="folder for comm_bench*.json and the plots",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from freescale_comm.options import FreescaleOptions

    try:  # what every rank would read: refused here, not as a traceback from each rank
        FreescaleOptions.from_env()
    except ValueError as err:
        args.parser.error(f"environment: {err}")
    if args.command == "info":
        if args.ranks == 1:
            args.parser.error("--ranks: 0 (no ranks) or at least 2 (a pair to show)")
        if args.hosts > args.ranks:
            args.parser.error(f"--hosts ({args.hosts}) needs --ranks of at least as many")
        from freescale_comm.info import collect, format_info

        info = collect()
        if args.ranks:
            from freescale_comm.info import local_paths

            info["paths"] = local_paths(args.ranks, args.hosts)
        print(json.dumps(info, indent=2) if args.json else format_info(info))
        return 0
    from freescale_comm.bench import BenchConfig, format_table, run_bench, write_report

    if args.min_calls > BenchConfig.max_calls:
        args.parser.error(f"--min-calls ({args.min_calls}) exceeds {BenchConfig.max_calls}")
    if args.min_bytes > args.max_bytes:
        args.parser.error(f"--min-bytes ({args.min_bytes}) exceeds --max-bytes ({args.max_bytes})")
    from freescale_comm.cpu import usable_cores

    cores = usable_cores()  # 100000 threads per rank hung the ranks until the timeout
    if args.threads > cores:
        args.parser.error(f"--threads ({args.threads}) exceeds the {cores} cores this may use")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            args.parser.error("--device cuda: this machine has no CUDA device torch can use")
    try:  # before any rank starts: a sweep is minutes of work to lose at the end
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        args.parser.error(f"--out {args.out}: cannot make the folder ({err.strerror})")
    try:  # a folder that exists may still refuse files (permissions, /proc, /sys)
        tempfile.TemporaryFile(dir=args.out).close()
    except OSError as err:
        args.parser.error(f"--out {args.out}: cannot write there ({err.strerror})")
    reports = []
    for world_size in args.world_sizes:
        config = BenchConfig(
            world_size=world_size,
            min_bytes=args.min_bytes,
            max_bytes=args.max_bytes,
            factor=args.factor,
            ops=args.ops,
            warmup=args.warmup,
            blocks=args.blocks,
            target_s=args.target_s,
            min_calls=args.min_calls,
            device=args.device,
            threads=args.threads,
            huge_pages=args.huge_pages,
        )
        report = run_bench(config, progress=True)
        reports.append(report)
        print(format_table(report))
        written = write_report(report, args.out)
        print_written(written, "./freescale_comm[plot]")
    combined = args.out / "comm_bench.json"
    command = "freescale comm " + " ".join(argv if argv is not None else sys.argv[2:])
    combined.write_text(json.dumps({"command": command, "reports": reports}, indent=2))
    print(f"wrote {combined} (every world size)")
    return 0
