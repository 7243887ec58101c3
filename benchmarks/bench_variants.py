"""Side by side: several runs of ``freescale comm bench`` under variants of the code or of its
options (an A/B, a sweep of ``FREESCALE_*`` knobs), as freescale's paired ratio to Gloo's time
per cell, one line per variant.

Each run is a bench ``--out`` folder named ``<variant><round>`` (``old1``, ``new2``,
``knob_one_thread1``); a variant's name must not end in a digit. Per variant and cell (op,
ranks, size) it keeps every round's paired ratio and their median, and plots the medians, one
panel per op and rank count, with each round's ratio as a dot.

    python benchmarks/bench_variants.py DIR [--variants old,new] [--json FILE] [--plot FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

Cell = tuple[str, int, int]  # op, ranks, size in bytes


def load(folder: Path) -> dict[str, dict[Cell, list[float]]]:
    """Per variant, per cell, the paired ratio of each round found under ``folder``."""
    ratios: dict[str, dict[Cell, list[float]]] = {}
    for report_file in sorted(folder.glob("*/comm_bench.json")):
        match = re.fullmatch(r"(.+?)(\d+)", report_file.parent.name)
        if match is None:
            continue
        variant = match.group(1)
        for report in json.loads(report_file.read_text())["reports"]:
            for row in report["rows"]:
                cell = (row["op"], row["world_size"], row["size"])
                ratios.setdefault(variant, {}).setdefault(cell, []).append(row["paired_ratio"])
    return ratios


def summary(ratios: dict[str, dict[Cell, list[float]]]) -> list[dict[str, Any]]:
    """One row per variant and cell: its rounds' ratios and their median."""
    return [
        {
            "variant": variant,
            "op": op,
            "ranks": ranks,
            "size": size,
            "paired_ratios": values,
            "median": statistics.median(values),
        }
        for variant, cells in ratios.items()
        for (op, ranks, size), values in sorted(cells.items())
    ]


def plot(rows: list[dict[str, Any]], variants: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["op"], r["ranks"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (op, ranks) in zip(axes[0], panels, strict=True):
        for variant in variants:
            mine = [r for r in rows if (r["variant"], r["op"], r["ranks"]) == (variant, op, ranks)]
            sizes = [r["size"] / 2**20 for r in mine]
            (line,) = ax.plot(sizes, [r["median"] for r in mine], marker="o", label=variant)
            for size, r in zip(sizes, mine, strict=True):
                ax.scatter(
                    [size] * len(r["paired_ratios"]),
                    r["paired_ratios"],
                    s=8,
                    color=line.get_color(),
                    alpha=0.5,
                )
        ax.axhline(0.5, color="grey", linestyle=":", linewidth=1)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{op}, {ranks} ranks")
        ax.set_xlabel("size (MiB)")
        ax.set_ylabel("freescale / Gloo time (paired)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="holds the runs' --out folders")
    parser.add_argument("--variants", help="comma-separated, in this order (default: all found)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    args = parser.parse_args()
    ratios = load(args.folder)
    variants = args.variants.split(",") if args.variants else sorted(ratios)
    missing = [v for v in variants if v not in ratios]
    if missing:
        parser.error(f"no runs of {missing} under {args.folder} (found {sorted(ratios)})")
    rows = [r for r in summary(ratios) if r["variant"] in variants]
    width = max(len(v) for v in variants)
    for op, ranks, size in sorted({(r["op"], r["ranks"], r["size"]) for r in rows}):
        cells = []
        for variant in variants:
            found = [
                r
                for r in rows
                if (r["variant"], r["op"], r["ranks"], r["size"]) == (variant, op, ranks, size)
            ]
            if found:
                values = " ".join(f"{v:.2f}" for v in found[0]["paired_ratios"])
                cells.append(f"{variant:>{width}} {found[0]['median']:.2f} ({values})")
        print(f"{op:10s} {ranks} {size >> 20:3d} MiB | " + " | ".join(cells))
    if args.json:
        args.json.write_text(json.dumps({"folder": str(args.folder), "rows": rows}, indent=1))
    if args.plot:
        plot(rows, variants, args.plot)


if __name__ == "__main__":
    main()
