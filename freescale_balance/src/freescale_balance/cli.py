"""``freescale balance ...`` subcommands."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from freescale_balance._freescale_args import (
    Parser,
    float_in,
    int_at_least,
    int_list,
    joined,
    print_written,
)
from freescale_balance.cost_model import CostModel
from freescale_balance.simulate import (
    LengthDistribution,
    SimulationConfig,
    format_table,
    headline,
    simulate,
    write_report,
)


def _parser() -> Parser:
    defaults = SimulationConfig()
    dist_defaults = LengthDistribution()
    cost_defaults = CostModel()
    parser = Parser(prog="freescale balance")
    commands = parser.add_subparsers(dest="command", required=True)
    what = "straggler % of none / FBS / VBS / KK over world sizes and max UIH (simulated)"
    sim = commands.add_parser("simulate", help=what.replace("%", "%%"), description=what)
    sim.set_defaults(parser=sim)
    sim.add_argument(
        "--world-sizes",
        type=int_list(1),
        default=joined(defaults.world_sizes),
        help="comma-separated ranks of each simulated cluster",
    )
    sim.add_argument(
        "--max-uih",
        type=int_list(1),
        default=joined(defaults.max_uih),
        help="comma-separated caps of the UIH (user interaction history) length",
    )
    sim.add_argument(
        "--local-batch",
        type=int_at_least(1),
        default=defaults.local_batch,
        help="samples per rank and step",
    )
    sim.add_argument(
        "--steps",
        type=int_at_least(1),
        default=defaults.steps,
        help="global batches per point, the warm-up steps included",
    )
    sim.add_argument(
        "--warmup-steps",
        type=int_at_least(0),
        default=defaults.warmup_steps,
        help="first steps left out of the median (VBS's exponent settles)",
    )
    sim.add_argument("--seed", type=int, default=defaults.seed, help="seed of the length draws")
    sim.add_argument(
        "--sigma",
        type=float_in(0.0, open_low=True),
        default=dist_defaults.sigma,
        help="log-normal sigma of UIH lengths",
    )
    sim.add_argument(
        "--median-fraction",
        type=float_in(0.0, 1.0, open_low=True),
        default=dist_defaults.median_fraction,
        help="median UIH length as a fraction of the max UIH",
    )
    sim.add_argument(
        "--median",
        type=float_in(0.0, open_low=True),
        default=None,
        help="fixed median UIH length (overrides --median-fraction)",
    )
    sim.add_argument(
        "--cost",
        type=float_in(0.0),
        nargs=3,
        metavar=("A", "B", "C"),
        default=(cost_defaults.quadratic, cost_defaults.linear, cost_defaults.constant),
        help="cost model a*L^2 + b*L + c of a sample of length L",
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
    if args.steps <= args.warmup_steps:
        args.parser.error(
            f"--steps ({args.steps}) must exceed --warmup-steps ({args.warmup_steps}): "
            "the warm-up steps are not measured"
        )
    config = SimulationConfig(
        world_sizes=args.world_sizes,
        max_uih=args.max_uih,
        local_batch=args.local_batch,
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        distribution=LengthDistribution(args.sigma, args.median_fraction, args.median),
        cost_model=CostModel(*args.cost),
    )
    report = simulate(config, progress=True)
    print(format_table(report))
    line = headline(report)
    if line:
        print(line)
    written = write_report(report, args.out)
    print_written(written, "./freescale_balance[plot]")
    return 0
