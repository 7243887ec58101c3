"""GPU checks and measurements of freescale_embed's CUDA path, in one call.

Two ranks, one GPU each where the machine has two (rank r uses GPU r % device count), else both
on GPU 0 over the ``freescale`` backend (NCCL refuses two ranks on one GPU). In order, each part
reported even if the other fails:

1. exactness: per collision rate and optimizer (SGD, row-wise Adagrad), ``--steps`` training
   steps of three tables (one read by two features) in sync and prioritized mode on the GPU,
   and in sync mode on the CPU (a Gloo group, the same batches): prioritized must equal sync
   bitwise (every output of every step, tables, optimizer state), and sync on the GPU must
   match sync on the CPU to float32 rounding (their segment sums add in different orders);
2. bench: ``freescale embed bench`` on the GPU (``freescale_embed.bench.run_bench``):
   exposed embedding communication per step, sync vs prioritized, at collision rates
   0-50%, with the dense compute emulated by bf16 matmuls on the training stream.

Writes ``embed_gpu.json`` (and the bench's ``embed_bench.json`` / ``.png``) under ``--out``
(default ``$OUT`` or ``out/embed_gpu``) after every part and prints a table last. On the GPU
machine, from the project root, with ucxx installed and PYTHONPATH naming freescale_comm/src,
freescale_balance/src, kernels/src and freescale_embed/src:
``python3 benchmarks/embed_gpu.py --out $OUT``. ``--device cpu --backend gloo --quick`` runs the
same structure on a CPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from freescale_balance import JaggedBatch
from freescale_embed import SGD, RowWiseAdagrad, ShardedEmbeddingCollection, TableConfig
from freescale_embed._local_ranks import GroupSpec, RankFailure, run_ranks
from freescale_embed.bench import (
    BenchConfig,
    format_table,
    on_device,
    rank_device,
    run_bench,
    write_report,
)
from freescale_embed.workload import WorkloadConfig, make_batch

WORLD = 2
OPTIMIZERS = {"sgd": SGD(lr=0.1), "rowwise_adagrad": RowWiseAdagrad(lr=0.1)}
# "items" is read by two features; "tiny" has fewer rows than ranks on some worlds.
TABLES = (
    TableConfig("items", 50_000, 64, ["history", "candidates"]),
    TableConfig("categories", 1_000, 16, ["category"]),
    TableConfig("tiny", 3, 4, ["flag"]),
)


# ----------------------------------------------------------------------------- 1. exactness
def _train(
    mode: str,
    optimizer: Any,
    batches: list[JaggedBatch],
    device: torch.device,
    group: Any,
) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Outputs of every step (on the CPU) and the final full state of one training run."""
    emb = ShardedEmbeddingCollection(
        TABLES, group=group, optimizer=optimizer, mode=mode, seed=3, device=device
    )
    rank = dist.get_rank()
    outputs = []
    for step, batch in enumerate(batches):
        on = on_device(batch, device)
        if mode == "sync":
            out = emb(on)
        else:
            last = step + 1 == len(batches)
            out = emb(on, None if last else on_device(batches[step + 1], device), final=last)
        generator = torch.Generator().manual_seed(rank * 100_003 + step)
        loss = sum(
            (o.values * torch.randn(o.values.shape, generator=generator).to(device)).sum()
            for o in out.values()
        )
        loss.backward()
        outputs.append({k: o.values.detach().cpu() for k, o in out.items()})
    state = {k: v.cpu() for k, v in emb.state_dict(full=True).items()}
    emb.close()
    return outputs, state


def _exactness(device: torch.device, control: Any, rates: list[float], steps: int) -> list[dict]:
    rank = dist.get_rank()
    rows = []
    for rate in rates:
        workload = WorkloadConfig(
            tables=TABLES,
            world_size=WORLD,
            batch_size=16,
            rows_per_step=4096,
            collision_rate=rate,
            seed=11,
        )
        batches = [make_batch(workload, rank, step) for step in range(steps)]
        for name, optimizer in OPTIMIZERS.items():
            started = time.perf_counter()
            sync_out, sync_state = _train("sync", optimizer, batches, device, None)
            prio_out, prio_state = _train("prioritized", optimizer, batches, device, None)
            cpu_out, cpu_state = _train("sync", optimizer, batches, torch.device("cpu"), control)
            bitwise = all(
                torch.equal(a[k], b[k]) for a, b in zip(sync_out, prio_out, strict=True) for k in a
            ) and all(torch.equal(v, prio_state[k]) for k, v in sync_state.items())
            close = True
            worst = 0.0
            for got, want in [*zip(sync_out, cpu_out, strict=True), (sync_state, cpu_state)]:
                for key, value in got.items():
                    if value.is_floating_point() and value.numel():
                        worst = max(worst, float((value - want[key]).abs().max()))
                        # Float32 rounding of sums taken in another order (a pairwise tree
                        # on CUDA, index_add_ on the CPU), accumulated over the steps.
                        close &= torch.allclose(value, want[key], rtol=1e-4, atol=1e-5)
            flags = torch.tensor([float(bitwise), float(close)])
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=control)
            rows.append(
                {
                    "collision_rate": rate,
                    "optimizer": name,
                    "steps": steps,
                    "prioritized_bitwise_sync": bool(flags[0]),
                    "sync_close_to_cpu": bool(flags[1]),
                    "max_abs_diff_vs_cpu": worst,
                    "seconds": round(time.perf_counter() - started, 1),
                }
            )
    return rows


def _exact_rank(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One rank of the exactness part, on the launcher's group (its device already current)."""
    config = BenchConfig(world_size=WORLD, device=args.device, backend=args.backend)
    device = rank_device(config, dist.get_rank())
    control = dist.new_group(backend="gloo")  # the CPU reference's group
    rates = [0.05, 0.5] if args.quick else [0.0, 0.05, 0.2, 0.5]
    return _exactness(device, control, rates, 5 if args.quick else args.steps)


def _run_exactness(args: argparse.Namespace) -> Any:
    """Rank 0's results, or every rank's outcome when one failed."""
    spec = GroupSpec(
        WORLD,
        args.backend,
        init_timeout_s=300.0,
        setup="freescale_comm:register" if args.backend == "freescale" else None,
        threads=None,
        device=args.device,
    )
    try:
        return run_ranks(spec, _exact_rank, args, timeout_s=args.timeout)[0]
    except RankFailure as failure:
        results: dict[Any, Any] = dict(failure.results)
        for rank, (kind, detail) in failure.failures.items():
            results[rank] = {kind: detail[-3000:]}
        return results


# ----------------------------------------------------------------------------- 2. bench
def _bench_config(args: argparse.Namespace) -> BenchConfig:
    if args.quick:
        return BenchConfig(
            world_size=WORLD,
            collision_rates=(0.0, 0.05, 0.5),
            steps=3,
            warmup=1,
            num_embeddings=20_000,
            rows_per_step=2048,
            dense="gpu" if args.device == "cuda" else "sleep",
            dense_ms=5.0,
            device=args.device,
            backend=args.backend,
        )
    cuda = args.device == "cuda"
    return BenchConfig(
        world_size=WORLD,
        collision_rates=(0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5),
        steps=args.steps,
        warmup=3,
        dense=args.dense if cuda else "sleep",
        dense_ms=args.dense_ms,
        matmul_size=8192 if cuda else 512,
        optimizer_params=args.optimizer_params,
        device=args.device,
        backend=args.backend,
    )


# ----------------------------------------------------------------------------- driver
def _table(report: dict[str, Any]) -> str:
    lines = ["== freescale_embed on " + report["info"]["device_name"] + " =="]
    exact = report.get("exactness")
    if isinstance(exact, list):
        for row in exact:
            lines.append(
                f"exact {row['optimizer']:<16} {100 * row['collision_rate']:>4.0f}% "
                f"{row['steps']} steps: prioritized==sync "
                f"{'yes' if row['prioritized_bitwise_sync'] else 'NO'}, sync close to CPU "
                f"{'yes' if row['sync_close_to_cpu'] else 'NO'} (max |diff| "
                f"{row['max_abs_diff_vs_cpu']:.2e}), {row['seconds']} s"
            )
    else:
        lines.append(f"exactness: {exact}")
    bench = report.get("bench")
    if isinstance(bench, dict) and "points" in bench:
        lines.append(format_table(bench))
    else:
        lines.append(f"bench: {bench}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="embed_gpu")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/embed_gpu")))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--backend", default="freescale", help="freescale, gloo (CPU) or nccl")
    parser.add_argument("--steps", type=int, default=20, help="steps per exactness run / bench")
    parser.add_argument("--dense-ms", type=float, default=100.0, help="GPU dense compute per step")
    parser.add_argument(
        "--dense",
        choices=("gpu", "sleep"),
        default="gpu",
        help="dense compute on CUDA: bf16 matmuls, or a sleep that leaves the GPU to the "
        "embeddings (a control: the two ranks' processes then do not time-slice the GPU)",
    )
    parser.add_argument(
        "--optimizer-params",
        type=int,
        default=0,
        help="dense parameters of a fused Adam step after each backward (0: none)",
    )
    parser.add_argument("--quick", action="store_true", help="a small dry run of every part")
    parser.add_argument("--timeout", type=float, default=420, help="seconds per part")
    parser.add_argument("--parts", default="exactness,bench")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    report: dict[str, Any] = {
        "info": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor() or "CPU",
            "gpus": torch.cuda.device_count() if cuda else 0,
            "backend": args.backend,
            "args": {k: str(v) for k, v in vars(args).items()},
        }
    }
    path = args.out / "embed_gpu.json"
    for part in args.parts.split(","):
        started = time.perf_counter()
        try:
            if part == "exactness":
                report[part] = _run_exactness(args)
            elif part == "bench":
                config = _bench_config(args)
                report[part] = run_bench(config, timeout_s=args.timeout)
                report["bench_files"] = [str(p) for p in write_report(report[part], args.out)]
                report["bench_config"] = asdict(config)
            else:
                raise ValueError(f"unknown part {part!r}")
        except Exception as err:  # report and go on: one broken part must not hide the other
            report[part] = {
                "error": f"{type(err).__name__}: {err}",
                "trace": traceback.format_exc()[-3000:],
            }
        report[f"{part}_s"] = round(time.perf_counter() - started, 1)
        print(f"{part} done in {report[f'{part}_s']} s", flush=True)
        # Written after every part: a later hang still leaves the earlier results.
        path.write_text(json.dumps(report, indent=2, default=str))
    print(_table(report))
    exact = report.get("exactness")
    ok = isinstance(exact, list) and all(
        r["prioritized_bitwise_sync"] and r["sync_close_to_cpu"] for r in exact
    )
    bench = report.get("bench")
    ok &= isinstance(bench, dict) and all(p["exact"] for p in bench.get("points", [{}]))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
