"""The side-by-side table of ``freescale train`` and the plots of ``freescale train report``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Balanced and unbalanced runs add the same float32 terms in another order; over hundreds of
# Adam steps that drifts by far less than this relative amount unless something is wrong.
LOSS_AGREEMENT = 1e-3


def loss_agreement(a: Sequence[float], b: Sequence[float]) -> float:
    """Largest relative difference of two loss curves, step by step."""
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / max(abs(x), abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def _run_cell(summary: dict[str, Any]) -> str:
    run = summary["run"]
    auto = " (auto)" if summary.get("mode_auto") else ""
    return f"{run['backend']} / {run['policy']} / {run['mode']}{auto}"


def table(summaries: Sequence[dict[str, Any]]) -> str:
    """The runs side by side, one column per run, and whether their loss curves agree."""
    rows = [
        ("backend / policy / mode", _run_cell),
        ("step time, median (ms)", lambda s: f"{s['step_ms']:.1f}"),
        ("step time, p90 (ms)", lambda s: f"{s['step_p90_ms']:.1f}"),
        ("slowest rank's compute (ms)", lambda s: f"{s['compute_ms']:.1f}"),
        ("  training thread on CPU (ms)", lambda s: f"{s['thread_cpu_ms']:.1f}"),
        ("straggler %", lambda s: f"{s['straggler_pct']:.1f}"),
        ("straggler wait (ms)", lambda s: f"{s['straggler_wait_ms']:.1f}"),
        ("exposed comm (ms)", lambda s: f"{sum(s['exposed_ms'].values()):.1f}"),
        ("  embedding", lambda s: f"{s['exposed_ms']['embedding']:.1f}"),
        ("  dense all-reduce", lambda s: f"{s['exposed_ms']['dense_allreduce']:.1f}"),
        ("  input (load + balance)", lambda s: f"{s['exposed_ms']['input']:.1f}"),
        ("  status exchange", lambda s: f"{s['exposed_ms']['status']:.1f}"),
        ("samples/s", lambda s: f"{s['samples_per_s']:.0f}"),
        ("tokens/s", lambda s: f"{s['tokens_per_s']:.0f}"),
        (
            "collision %",
            lambda s: "-" if s["collision_pct"] is None else f"{s['collision_pct']:.1f}",
        ),
        ("final loss (last 10 steps)", lambda s: f"{s['final_loss']:.4f}"),
        ("HR@10 / NDCG@10", lambda s: f"{s['hr@10']:.4f} / {s['ndcg@10']:.4f}"),
        (
            "popularity HR@10 / NDCG@10",
            lambda s: f"{s['popularity_hr@10']:.4f} / {s['popularity_ndcg@10']:.4f}",
        ),
    ]
    names = [s["run"]["name"] for s in summaries]
    cells = [[label, *[fmt(s) for s in summaries]] for label, fmt in rows]
    header = ["", *names]
    widths = [max(len(str(r[i])) for r in [header, *cells]) for i in range(len(header))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(str(v).ljust(w) for v, w in zip(values, widths, strict=True))

    text = [line(header), line(["-" * w for w in widths]), *[line(c) for c in cells]]
    for summary in summaries:
        if summary.get("mode_auto"):
            text.append(
                f"{summary['run']['name']}: mode auto chose {summary['run']['mode']} "
                f"({summary['mode_auto']})"
            )
        skipped = summary.get("balancing", {}).get("skipped")
        if skipped:
            text.append(f"{summary['run']['name']}: did not balance ({skipped})")
    base = summaries[0]
    for other in summaries[1:]:
        difference = loss_agreement(base["losses"], other["losses"])
        verdict = "agree" if difference <= LOSS_AGREEMENT else "DIFFER"
        if other["digest"] == base["digest"]:
            verdict += ", weights bitwise equal"
        text.append(
            f"loss curves of {base['run']['name']} and {other['run']['name']}: {verdict} "
            f"(largest relative difference over {len(base['losses'])} steps: {difference:.2e}; "
            f"tolerance {LOSS_AGREEMENT:g})"
        )
    return "\n".join(text)


def read_run(folder: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    summary = json.loads((folder / "summary.json").read_text())
    steps = [json.loads(line) for line in (folder / "steps.jsonl").read_text().splitlines()]
    return summary, steps


def plot(directory: Path) -> Path:
    """Draws every run under ``directory``: step time split into compute and each bubble, loss,
    straggler %. Returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    listing = directory / "summary.json"
    if not listing.exists():
        raise FileNotFoundError(f"no run under {directory} (expected {listing})")
    names = [summary["run"]["name"] for summary in json.loads(listing.read_text())]
    loaded = [read_run(directory / name) for name in names]
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    parts = ("compute", "straggler", "embedding", "dense_allreduce", "input", "status")
    bottoms = [0.0] * len(loaded)
    for part in parts:
        heights = []
        for summary, _ in loaded:
            if part == "compute":
                heights.append(summary["mean_compute_ms"])
            elif part == "straggler":
                heights.append(summary["straggler_wait_ms"])
            else:
                heights.append(summary["exposed_ms"][part])
        axes[0].bar(names, heights, bottom=bottoms, label=part)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    axes[0].set_ylabel("ms per step (medians)")
    axes[0].set_title("where a step's time goes")
    axes[0].legend(fontsize=8, loc="lower right")
    axes[0].tick_params(axis="x", labelrotation=20)
    for summary, steps in loaded:
        name = summary["run"]["name"]
        axes[1].plot([s["step"] for s in steps], [s["loss"] for s in steps], label=name)
        axes[2].plot([s["step"] for s in steps], [s["straggler_pct"] for s in steps], label=name)
    axes[1].set_title("loss")
    axes[1].set_xlabel("step")
    axes[2].set_title("straggler % ((max - mean) / max compute)")
    axes[2].set_xlabel("step")
    for axis in axes[1:]:
        axis.legend()
    figure.tight_layout()
    path = directory / "report.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
