"""Where a training step's time goes: each FreeScale technique alone and all together.

One call per machine, on ``freescale train``'s SASRec and synthetic data (long-tailed
histories):

- ``cpu``: 2 and 4 ranks on the CPU, every configuration (``CPU_RUNS``);
- ``cuda``: 2 ranks sharing one GPU, every configuration (``CUDA_RUNS``), deterministic kernels
  so that prioritized and sync runs can be compared bit for bit;
- ``gpus``: one rank per GPU on a machine with 2 or more, at each GPU count of ``--gpu-worlds``,
  the baseline over NCCL against each technique and FreeScale whole (``GPU_RUNS``), and
  samples/s against GPU count;
- ``scale``: the straggler and compute bubble of 8-256 simulated ranks, the real model's
  forward and backward per rank (``freescale_embed.train.scale``);
- ``collisions``: collision % between consecutive steps of the data as histories grow.

Per configuration: step time (median, p90), compute per rank, straggler %, each bubble
(straggler wait, exposed embedding communication, exposed balancer communication, dense
all-reduce), samples/s, tokens/s, collision %, peak host and device memory (sync runs hold no
prefetched rows, prioritized runs do: ``prefetch MB``). Exactness is checked in the same run:
prioritized against sync with the same balancing (weights' digests equal), balanced against
unbalanced (loss curves within float rounding). JSON, plots, and the tables printed last.

Usage::

    python3 benchmarks/train_e2e.py --out DIR                     # the GPU machine: everything
    python3 benchmarks/train_e2e.py --out DIR --parts cpu --quick # a small CPU dry run
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from freescale_embed.train import cli
from freescale_embed.train.report import LOSS_AGREEMENT, loss_agreement
from freescale_embed.train.scale import ScaleConfig, simulate
from freescale_embed.train.scale import table as scale_table

# (label, freescale train run): baseline first, then one technique at a time, then together.
CPU_RUNS: tuple[tuple[str, str], ...] = (
    ("baseline", "gloo:none:sync"),
    ("+FBS", "gloo:fbs:sync"),
    ("+KK", "gloo:kk:sync"),
    ("+VBS", "gloo:vbs:sync"),
    ("+prioritized", "gloo:none:prioritized"),
    ("+freescale backend", "freescale:none:sync"),
    ("FBS+prioritized", "gloo:fbs:prioritized"),
    ("FreeScale (all)", "freescale:fbs:prioritized"),
)
# NCCL cannot put two ranks on one GPU: the baseline's backend is freescale there (the dense
# all-reduce runs on Gloo), so "+freescale backend" is the baseline itself. Ranks sharing a GPU
# do not balance (``freescale train``'s rule), so balancing alone would be the baseline again,
# and "FreeScale (all)" trains as "+prioritized" does (a second run of it).
CUDA_RUNS: tuple[tuple[str, str], ...] = (
    ("baseline", "freescale:none:sync"),
    ("+prioritized", "freescale:none:prioritized"),
    ("FreeScale (all)", "freescale:fbs:prioritized"),
)
# One rank per GPU: the baseline is what users run today, NCCL for every collective.
GPU_RUNS: tuple[tuple[str, str], ...] = (
    ("baseline", "nccl:none:sync"),
    ("+FBS", "nccl:fbs:sync"),
    ("+KK", "nccl:kk:sync"),
    ("+VBS", "nccl:vbs:sync"),
    ("+prioritized", "nccl:none:prioritized"),
    ("+freescale backend", "freescale:none:sync"),
    ("FBS+prioritized", "nccl:fbs:prioritized"),
    ("FreeScale (all)", "freescale:fbs:prioritized"),
)
# (prioritized, sync with the same backend and the same partitions): must give equal weights.
BITWISE_PAIRS = (
    ("+prioritized", "baseline"),
    ("FBS+prioritized", "+FBS"),
    ("FreeScale (all)", "+FBS"),
    ("FreeScale (all)", "baseline"),
)

CPU_MODEL = [
    "--device", "cpu", "--max-history", "4096", "--items", "65536", "--users", "8192",
    "--dim", "32", "--layers", "1", "--heads", "2", "--negatives", "32", "--eval-users", "64",
]  # fmt: skip
CUDA_MODEL = [
    "--device", "cuda", "--dim", "128", "--layers", "2", "--heads", "4", "--max-history", "8192",
    "--users", "16384", "--items", "100000", "--negatives", "128", "--eval-users", "256",
    "--threads", "4", "--deterministic",
]  # fmt: skip
# One rank per GPU runs the shared-GPU part's model, deterministic kernels included, so that
# prioritized and sync compare bit for bit in the same run.
GPU_MODEL = CUDA_MODEL
QUICK_MODEL = [
    "--device", "cpu", "--max-history", "256", "--items", "2048", "--users", "512", "--dim", "16",
    "--layers", "1", "--heads", "2", "--negatives", "8", "--eval-users", "16",
]  # fmt: skip


def _train(out: Path, argv: Sequence[str], runs: Sequence[tuple[str, str]]) -> list[dict]:
    spec = ",".join(run for _, run in runs)
    code = cli.main([*argv, "--runs", spec, "--out", str(out)])
    if code != 0:
        raise SystemExit(f"freescale train {' '.join(argv)} exited with {code}")
    summaries = json.loads((out / "summary.json").read_text())
    for (label, _), summary in zip(runs, summaries, strict=True):
        summary["label"] = label
    return summaries


def row(summary: dict[str, Any]) -> dict[str, Any]:
    """The figures of one configuration (ms, MB, %)."""
    exposed = summary["exposed_ms"]
    bubbles = {
        "straggler_wait_ms": summary["straggler_wait_ms"],
        "embedding_ms": exposed["embedding"],
        "balancer_ms": exposed["input"],
        "dense_allreduce_ms": exposed["dense_allreduce"],
        "status_ms": exposed["status"],
    }
    return {
        "label": summary["label"],
        "run": summary["run"],
        "step_ms": summary["step_ms"],
        "step_p90_ms": summary["step_p90_ms"],
        "compute_ms": summary["compute_ms"],
        "mean_compute_ms": summary["mean_compute_ms"],
        "thread_cpu_ms": summary["thread_cpu_ms"],
        "straggler_pct": summary["straggler_pct"],
        **bubbles,
        "bubble_ms": sum(bubbles.values()),
        "samples_per_s": summary["samples_per_s"],
        "tokens_per_s": summary["tokens_per_s"],
        "collision_pct": summary["collision_pct"],
        "prefetch_mb": summary["prefetch_mb"],
        "peak_host_mb": summary["peak_host_mb"],
        # The runs share their processes: what this one added to the resident size.
        "host_growth_mb": summary["peak_host_mb"] - summary.get("host_start_mb", 0.0),
        "peak_device_mb": summary["peak_device_mb"],
        "digest": summary["digest"],
    }


def _placement(summary: dict[str, Any]) -> str | None:
    """Which samples each rank computed, over the whole run (``None``: where they were loaded)."""
    balancing = summary.get("balancing", {})
    return balancing.get("partition_digest") if balancing.get("balanced") else None


def exactness(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Prioritized vs sync digests; every run's loss curve against the baseline's.

    A pair is compared bit for bit when both runs used the same backend and placed every sample
    alike: FBS fit to measured times may partition two runs differently (``placement_differs``
    lists those pairs; their loss curves are still compared to float rounding)."""
    by_label = {s["label"]: s for s in summaries}
    pairs = [
        (a, b)
        for a, b in BITWISE_PAIRS
        if a in by_label
        and b in by_label
        and by_label[a]["run"]["backend"] == by_label[b]["run"]["backend"]
    ]
    alike = [(a, b) for a, b in pairs if _placement(by_label[a]) == _placement(by_label[b])]
    bitwise = {f"{a} == {b}": by_label[a]["digest"] == by_label[b]["digest"] for a, b in alike}
    base = by_label["baseline"]["losses"]
    losses = {
        s["label"]: loss_agreement(base, s["losses"]) for s in summaries if s["label"] != "baseline"
    }
    return {
        "prioritized_equals_sync_bitwise": bitwise,
        "placement_differs": [f"{a} vs {b}" for a, b in pairs if (a, b) not in alike],
        "loss_max_relative_difference": losses,
        "losses_agree": all(v <= LOSS_AGREEMENT for v in losses.values()),
        "all_bitwise": all(bitwise.values()),
    }


def verdict(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The issue's target on real ranks: all together no longer than the baseline, and shorter
    where the baseline's bubble is above 10% of its step."""
    base = next(r for r in rows if r["label"] == "baseline")
    together = next(r for r in rows if r["label"] == "FreeScale (all)")
    bubble_share = base["bubble_ms"] / base["step_ms"]
    return {
        "baseline_bubble_pct": 100.0 * bubble_share,
        "speedup": base["step_ms"] / together["step_ms"],
        "no_longer": together["step_ms"] <= base["step_ms"],
        "shorter_needed": bubble_share > 0.10,
        "met": together["step_ms"] <= base["step_ms"]
        and (bubble_share <= 0.10 or together["step_ms"] < base["step_ms"]),
    }


COLUMNS = (
    ("config", "label", "{}"),
    ("step", "step_ms", "{:.1f}"),
    ("p90", "step_p90_ms", "{:.1f}"),
    ("compute max", "compute_ms", "{:.1f}"),
    ("mean", "mean_compute_ms", "{:.1f}"),
    ("strag %", "straggler_pct", "{:.1f}"),
    ("strag wait", "straggler_wait_ms", "{:.1f}"),
    ("emb", "embedding_ms", "{:.1f}"),
    ("bal", "balancer_ms", "{:.1f}"),
    ("allred", "dense_allreduce_ms", "{:.1f}"),
    ("status", "status_ms", "{:.1f}"),
    ("samples/s", "samples_per_s", "{:.0f}"),
    ("tokens/s", "tokens_per_s", "{:.0f}"),
    ("coll %", "collision_pct", "{:.1f}"),
    ("prefetch MB", "prefetch_mb", "{:.2f}"),
    ("host MB", "peak_host_mb", "{:.0f}"),
    ("host +MB", "host_growth_mb", "{:.0f}"),
    ("dev MB", "peak_device_mb", "{:.0f}"),
)


def setting_table(name: str, setting: dict[str, Any]) -> str:
    """One setting's configurations as rows (times in ms), its exactness and verdict."""
    cells = [[title for title, _, _ in COLUMNS]]
    for r in setting["rows"]:
        cells.append(["-" if r.get(k) is None else f.format(r[k]) for _, k, f in COLUMNS])
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = [f"== {name} (ms unless noted) =="]
    for c in cells:
        lines.append(
            "  ".join(
                v.ljust(w) if i == 0 else v.rjust(w)
                for i, (v, w) in enumerate(zip(c, widths, strict=True))
            )
        )
    exact = setting["exactness"]
    differs = exact.get("placement_differs")
    lines.append(
        "exactness: "
        + ", ".join(f"{k}: {v}" for k, v in exact["prioritized_equals_sync_bitwise"].items())
        + (f" (other partitions, not compared: {', '.join(differs)})" if differs else "")
        + f"; loss curves vs baseline: largest relative difference "
        f"{max(exact['loss_max_relative_difference'].values()):.2e} "
        f"({'agree' if exact['losses_agree'] else 'DIFFER'}, tolerance {LOSS_AGREEMENT:g})"
    )
    v = setting["verdict"]
    lines.append(
        f"target: baseline bubble {v['baseline_bubble_pct']:.1f}% of its step; FreeScale "
        f"{v['speedup']:.2f}x the baseline's speed: {'met' if v['met'] else 'MISSED'}"
    )
    return "\n".join(lines)


def run_setting(out: Path, argv: Sequence[str], runs: Sequence[tuple[str, str]]) -> dict:
    started = time.time()
    summaries = _train(out, argv, runs)
    rows = [row(s) for s in summaries]
    return {
        "argv": list(argv),
        "rows": rows,
        "exactness": exactness(summaries),
        "verdict": verdict(rows),
        "wall_s": time.time() - started,
    }


def collision_curve(
    max_histories: Sequence[int], global_batch: int, num_items: int, steps: int, seed: int = 0
) -> list[dict[str, Any]]:
    """Collision % (rows step t+1 shares with step t, over step t+1's rows) of the synthetic
    data, as ``freescale train`` reads it (histories and negatives), per maximum history."""
    from freescale_embed.data import SyntheticConfig, synthetic_batches

    points = []
    for max_history in max_histories:
        config = SyntheticConfig(
            num_users=max(global_batch * (steps + 1), 4096),
            num_items=num_items,
            max_history=max_history,
            global_batch_size=global_batch,
            num_negatives=128,
            num_steps=steps + 1,
            seed=seed,
        )
        rows = [
            np.unique(
                np.concatenate([b.features[f].values.numpy() for f in ("history", "negatives")])
            )
            for b in synthetic_batches(config, 0, 1)
        ]
        shares = [
            100.0 * np.intersect1d(a, b, assume_unique=True).size / b.size
            for a, b in itertools.pairwise(rows)
        ]
        points.append(
            {
                "max_history": max_history,
                "global_batch": global_batch,
                "num_items": num_items,
                "collision_pct": float(np.median(shares)),
                "unique_rows": float(np.median([r.size for r in rows])),
            }
        )
    return points


def plot(results: dict[str, Any], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    settings = results.get("settings", {})
    parts = ["straggler_wait_ms", "embedding_ms", "balancer_ms", "dense_allreduce_ms", "status_ms"]
    if settings:
        fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4.5), squeeze=False)
        for ax, (name, setting) in zip(axes[0], settings.items(), strict=True):
            labels = [r["label"] for r in setting["rows"]]
            bottom = np.array([r["mean_compute_ms"] for r in setting["rows"]])
            ax.bar(labels, bottom, label="mean compute")
            for part in parts:
                values = np.array([r[part] for r in setting["rows"]])
                ax.bar(labels, values, bottom=bottom, label=part.removesuffix("_ms"))
                bottom = bottom + values
            ax.scatter(
                labels,
                [r["step_ms"] for r in setting["rows"]],
                color="k",
                zorder=3,
                label="step (median)",
            )
            ax.set_title(name)
            ax.set_ylabel("ms")
            ax.tick_params(axis="x", rotation=60)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "ablation.png", dpi=120)
        plt.close(fig)
    scale = results.get("scale")
    if scale and scale["points"]:
        worlds = sorted({p["world_size"] for p in scale["points"]})
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for n in worlds:
            points = sorted(
                (p for p in scale["points"] if p["world_size"] == n), key=lambda p: p["max_history"]
            )
            hist = [p["max_history"] for p in points]
            style = ["-", "--", ":", "-."][worlds.index(n) % 4]
            for color, policy in enumerate(points[0]["policies"]):
                axes[0].plot(
                    hist,
                    [p["policies"][policy]["straggler_pct"] for p in points],
                    marker="o",
                    linestyle=style,
                    color=f"C{color}",
                    label=f"N={n} {policy}",
                )
        axes[0].set_xlabel("max history")
        axes[0].set_ylabel("straggler %")
        axes[0].set_xscale("log", base=2)
        axes[0].legend(fontsize=6)
        curve = results.get("collisions") or []
        for items in sorted({c["num_items"] for c in curve}):
            points = [c for c in curve if c["num_items"] == items]
            axes[1].plot(
                [c["max_history"] for c in points],
                [c["collision_pct"] for c in points],
                marker="o",
                label=f"{items} items",
            )
        if curve:
            axes[1].legend(fontsize=7)
            axes[1].set_xscale("log", base=2)
            axes[1].set_xlabel("max history")
            axes[1].set_ylabel("collision % (consecutive steps)")
        fig.tight_layout()
        fig.savefig(out / "scale.png", dpi=120)
        plt.close(fig)


def _gpu_worlds(text: str) -> list[int]:
    """The GPU counts of the ``gpus`` part; refuses fewer than 2 GPUs before anything runs."""
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < 2:
        raise SystemExit(f"--parts gpus: needs 2 or more GPUs, this machine has {visible}")
    if text:
        worlds = [int(w) for w in text.split(",")]
    else:
        worlds = sorted({w for w in (2, 4, 8) if w <= visible} | {visible})
    if any(w < 2 or w > visible for w in worlds):
        raise SystemExit(f"--gpu-worlds: each count must be 2..{visible}, got {text}")
    return worlds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder (required)")
    parser.add_argument(
        "--parts",
        default="cpu,cuda,scale,collisions",
        help="comma-separated subset of cpu,cuda,gpus,scale,collisions,none "
        "(default: cpu,cuda,scale,collisions; gpus needs 2+ GPUs)",
    )
    parser.add_argument("--cpu-worlds", default="2,4", help="CPU rank counts (default: 2,4)")
    parser.add_argument("--cpu-steps", type=int, default=30, help="steps per CPU run (default: 30)")
    parser.add_argument(
        "--cpu-local-batch", type=int, default=8, help="samples per CPU rank (default: 8)"
    )
    parser.add_argument(
        "--cpu-threads", type=int, default=2, help="torch threads per CPU rank (default: 2)"
    )
    parser.add_argument(
        "--cuda-steps", type=int, default=30, help="steps per GPU run, cuda and gpus (default: 30)"
    )
    parser.add_argument(
        "--cuda-local-batch",
        type=int,
        default=32,
        help="samples per GPU rank, cuda and gpus (default: 32)",
    )
    parser.add_argument(
        "--gpu-worlds",
        default="",
        help="GPU counts of the gpus part, one rank per GPU (default: 2, 4, 8 up to the GPUs "
        "visible, and their number)",
    )
    parser.add_argument(
        "--scale-steps", type=int, default=2, help="simulated steps per point (default: 2)"
    )
    parser.add_argument(
        "--scale-budget-s",
        type=float,
        default=150.0,
        help="time bound of the simulation in seconds (default: 150)",
    )
    parser.add_argument(
        "--scale-rank-runs",
        type=int,
        default=1024,
        help="fewer steps past this many rank runs per point (default: 1024)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a CPU dry run)")
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="*",
        default=[],
        help="output folders of earlier calls whose results join this one's (--parts none: "
        "only merge and report)",
    )
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    unknown = parts - {"cpu", "cuda", "gpus", "scale", "collisions", "none"}
    if unknown:
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))}")
    gpu_worlds = _gpu_worlds(args.gpu_worlds) if "gpus" in parts else []
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    # Each call adds its parts to what earlier calls with the same --out measured.
    saved = out / "e2e.json"
    results: dict[str, Any] = json.loads(saved.read_text()) if saved.exists() else {}
    results.setdefault("settings", {})
    for folder in args.merge:
        other = json.loads((folder / "e2e.json").read_text())
        if "scale" not in other and (folder / "scale.json").exists():  # cut short by its bound
            other["scale"] = json.loads((folder / "scale.json").read_text())
        results["settings"].update(other.pop("settings", {}))
        results.setdefault("calls", []).extend(other.pop("calls", []))
        other.pop("wall_s", None)
        results.update(other)
    results.setdefault("calls", []).append(sys.argv[1:] if argv is None else list(argv))
    started = time.time()

    def save() -> None:
        (out / "e2e.json").write_text(json.dumps(results, indent=1) + "\n")

    cpu_model = QUICK_MODEL if args.quick else CPU_MODEL
    if "cpu" in parts:
        for world in (int(w) for w in args.cpu_worlds.split(",")):
            name = f"cpu_{world}ranks"
            argv_ = [
                *cpu_model, "--world-size", str(world), "--steps", str(args.cpu_steps),
                "--batch-size", str(world * args.cpu_local_batch),
                "--threads", str(args.cpu_threads),
            ]  # fmt: skip
            results["settings"][name] = run_setting(out / name, argv_, CPU_RUNS)
            save()
    if "cuda" in parts:
        argv_ = [
            *CUDA_MODEL, "--world-size", "2", "--steps", str(args.cuda_steps),
            "--batch-size", str(2 * args.cuda_local_batch),
        ]  # fmt: skip
        results["settings"]["cuda_2ranks_one_gpu"] = run_setting(
            out / "cuda_2ranks_one_gpu", argv_, CUDA_RUNS
        )
        save()
    for world in gpu_worlds:
        argv_ = [
            *GPU_MODEL, "--world-size", str(world), "--steps", str(args.cuda_steps),
            "--batch-size", str(world * args.cuda_local_batch),
        ]  # fmt: skip
        results["settings"][f"gpus_{world}"] = run_setting(out / f"gpus_{world}", argv_, GPU_RUNS)
        save()
    if "collisions" in parts:
        histories = (64, 128, 256) if args.quick else (1024, 2048, 4096, 8192, 16384, 21504)
        batch = 64 if args.quick else 1024
        results["collisions"] = [
            point
            for items in (100_000, 1_000_000)
            for point in collision_curve(histories, batch, items, 3)
        ]
        save()
    if "scale" in parts:
        config = ScaleConfig(
            steps=args.scale_steps,
            budget_s=args.scale_budget_s,
            rank_runs_per_point=args.scale_rank_runs,
        )
        if args.quick:
            config = replace(
                config, world_sizes=(2, 4), max_histories=(64, 128), local_batch=4,
                embedding_dim=16, num_layers=1, num_heads=2, num_negatives=8, num_items=1000,
                device="cpu", budget_s=None, calibration_ranks=4,
            )  # fmt: skip
        results["scale"] = simulate(config, out)
        save()
    results["wall_s"] = results.get("wall_s", 0.0) + time.time() - started
    save()
    plot(results, out)
    text = report(results)
    (out / "table.txt").write_text(text + "\n")
    print(text)
    return 0


def gpu_scaling(settings: dict[str, Any]) -> str:
    """Samples/s against GPU count for each configuration of the ``gpus`` part, with the
    scaling efficiency against the smallest count (1.00 = samples/s grew with the GPUs)."""
    worlds = sorted(int(name.split("_")[1]) for name in settings if name.startswith("gpus_"))
    if len(worlds) < 2:
        return ""
    lines = [f"== samples/s against GPU count ({', '.join(map(str, worlds))}) =="]
    base = {r["label"]: r["samples_per_s"] for r in settings[f"gpus_{worlds[0]}"]["rows"]}
    for label in base:
        cells = []
        for world in worlds:
            rows = {r["label"]: r for r in settings[f"gpus_{world}"]["rows"]}
            rate = rows[label]["samples_per_s"]
            efficiency = rate / base[label] * worlds[0] / world
            cells.append(f"{world}: {rate:8.0f} ({efficiency:4.2f})")
        lines.append(f"{label:<20} " + "  ".join(cells))
    return "\n".join(lines)


def report(results: dict[str, Any]) -> str:
    """Every table, the scale simulation's and the collision curve last."""
    blocks = [setting_table(name, s) for name, s in results["settings"].items()]
    scaling = gpu_scaling(results["settings"])
    if scaling:
        blocks.append(scaling)
    if results.get("collisions"):
        blocks.append(
            "== collision % between consecutive steps (synthetic data) ==\n"
            + "\n".join(
                f"max history {c['max_history']:>6}: {c['collision_pct']:5.1f}% of "
                f"{c['unique_rows']:.0f} rows (global batch {c['global_batch']}, "
                f"{c['num_items']} items)"
                for c in results["collisions"]
            )
        )
    if results.get("scale"):
        blocks.append(
            "== simulated ranks (compute per rank, real model) ==\n" + scale_table(results["scale"])
        )
    blocks.append(f"wall {results.get('wall_s', 0):.0f} s")
    return "\n\n".join(blocks)


if __name__ == "__main__":
    sys.exit(main())
