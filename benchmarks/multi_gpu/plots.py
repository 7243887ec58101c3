"""The figures: sweep.png (busbw and time per op) and overlap.png (slowdown per backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .report import overlap_combos, sweep_rows
from .settings import OPS, TARGET_PCT
from .sizes import fmt_size


def draw_plots(report: dict[str, Any], out: Path) -> list[str]:
    """Writes sweep.png and overlap.png under ``out``; the files written (or why none)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as err:
        return [f"no plots: {type(err).__name__}: {err}"]
    written = []
    rows = [r for r in sweep_rows(report) if "busbw_gbps" in r]
    if rows:
        fig, axes = plt.subplots(2, len(OPS), figsize=(6 * len(OPS), 8), squeeze=False)
        for col, op in enumerate(OPS):
            for backend in dict.fromkeys(r["backend"] for r in rows):
                pts = sorted(
                    (r["bytes"], r["busbw_gbps"], r["time_us"])
                    for r in rows
                    if r["op"] == op and r["backend"] == backend
                )
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                axes[0][col].plot(xs, [p[1] for p in pts], marker=".", label=backend)
                axes[1][col].plot(xs, [p[2] for p in pts], marker=".", label=backend)
            axes[0][col].set_title(op)
            axes[0][col].set_ylabel("busbw GB/s")
            axes[1][col].set_ylabel("time us (median)")
            for row in (0, 1):
                axes[row][col].set_xscale("log", base=2)
                axes[row][col].set_yscale("log")
                axes[row][col].set_xlabel("bytes")
                axes[row][col].grid(True, which="both", alpha=0.3)
            axes[0][col].legend(fontsize=8)
        fig.suptitle(f"freescale vs NCCL, {report['nprocs']} ranks")
        fig.tight_layout()
        fig.savefig(out / "sweep.png", dpi=110)
        plt.close(fig)
        written.append("sweep.png")
    combos = [(p, c) for p, c in overlap_combos(report) if "slowdown_pct_mean" in c]
    if combos:
        backends = list(dict.fromkeys(b for _, c in combos for b in c["slowdown_pct_mean"]))
        fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(combos)), 5))
        width = 0.8 / max(1, len(backends))
        for i, backend in enumerate(backends):
            xs = [
                j + i * width
                for j, (_, c) in enumerate(combos)
                if backend in c["slowdown_pct_mean"]
            ]
            ys = [
                c["slowdown_pct_mean"][backend]
                for _, c in combos
                if backend in c["slowdown_pct_mean"]
            ]
            ax.bar(xs, ys, width, label=backend)
        ax.axhline(TARGET_PCT, color="k", linestyle="--", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(combos))])
        ax.set_xticklabels(
            [
                f"{c['compute'][:10]}\n{c['op'].replace('_single', '')}\n"
                f"{fmt_size(c['bytes'])}" + ("" if p == "main" else f"\n[{p}]")
                for p, c in combos
            ],
            fontsize=7,
        )
        ax.set_ylabel("compute slowdown % (mean of ranks)")
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "overlap.png", dpi=110)
        plt.close(fig)
        written.append("overlap.png")
    return written
