"""``freescale balance ...`` subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from freescale_balance.cost_model import CostModel
from freescale_balance.simulate import (
    LengthDistribution,
    SimulationConfig,
    format_table,
    headline,
    simulate,
    write_report,
)


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(item) for item in text.split(",") if item)


def _parser() -> argparse.ArgumentParser:
    defaults = SimulationConfig()
    dist_defaults = LengthDistribution()
    cost_defaults = CostModel()
    parser = argparse.ArgumentParser(prog="freescale balance")
    commands = parser.add_subparsers(dest="command", required=True)
    sim = commands.add_parser(
        "simulate", help="straggler %% of none / FBS / VBS / KK over world sizes and max UIH"
    )
    sim.add_argument("--world-sizes", type=_int_list, default=defaults.world_sizes)
    sim.add_argument("--max-uih", type=_int_list, default=defaults.max_uih)
    sim.add_argument("--local-batch", type=int, default=defaults.local_batch)
    sim.add_argument("--steps", type=int, default=defaults.steps)
    sim.add_argument("--seed", type=int, default=defaults.seed)
    sim.add_argument(
        "--sigma", type=float, default=dist_defaults.sigma, help="log-normal sigma of UIH lengths"
    )
    sim.add_argument(
        "--median-fraction",
        type=float,
        default=dist_defaults.median_fraction,
        help="median UIH length as a fraction of the max UIH",
    )
    sim.add_argument(
        "--median",
        type=float,
        default=None,
        help="fixed median UIH length (overrides --median-fraction)",
    )
    sim.add_argument(
        "--cost",
        type=float,
        nargs=3,
        metavar=("A", "B", "C"),
        default=(cost_defaults.quadratic, cost_defaults.linear, cost_defaults.constant),
        help="cost model a*L^2 + b*L + c",
    )
    sim.add_argument(
        "--out",
        type=Path,
        default=Path("out/balance_simulate"),
        help="folder for straggler.json and straggler.png",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    config = SimulationConfig(
        world_sizes=args.world_sizes,
        max_uih=args.max_uih,
        local_batch=args.local_batch,
        steps=args.steps,
        seed=args.seed,
        distribution=LengthDistribution(args.sigma, args.median_fraction, args.median),
        cost_model=CostModel(*args.cost),
    )
    report = simulate(config)
    print(format_table(report))
    line = headline(report)
    if line:
        print(line)
    written = write_report(report, args.out)
    if len(written) == 1:
        print("matplotlib is not installed: no plot (pip install 'freescale-balance[plot]')")
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
