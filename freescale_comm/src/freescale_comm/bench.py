"""``freescale comm bench``: AllGather / AllToAll of freescale vs Gloo, nccl-tests style.

Local ranks on loopback run both backends in the same processes (a freescale world and a Gloo
group over the same ranks). Method, per size (as nccl-tests, ``doc/PERFORMANCE.md``):

1. warm-up calls of both backends (connections, caches, pages), then a correctness check of
   freescale's result against Gloo's;
2. calls per block from a second timed warm-up pass of the slower backend, so that a block lasts
   about ``target_s`` (the same count for both backends, agreed across ranks);
3. ``blocks`` measurement blocks per backend, freescale and Gloo alternating (ABBA order, so
   that neither always runs first after the other), a barrier only between blocks: each rank
   times its own block of back-to-back calls, per call;
4. per block the slowest rank's time (one reduction at the end, none while measuring); the
   figure is the median over blocks, with the fastest and slowest block beside it.

Columns as nccl-tests: size is the bytes one rank receives (AllGather: the whole output;
AllToAll: the whole output of ``all_to_all_single``), algbw = size / time, busbw = algbw *
(n - 1) / n for both collectives.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

OPS = ("all_gather", "all_to_all")
BACKENDS = ("freescale", "gloo")


@dataclass(frozen=True)
class BenchConfig:
    """What ``freescale comm bench`` measures.

    Attributes:
        world_size: local ranks.
        min_bytes: smallest size (size = bytes one rank receives).
        max_bytes: largest size.
        factor: ratio between consecutive sizes.
        ops: which collectives.
        warmup: calls per backend before a size is measured (twice: untimed, then timed to
            size the blocks).
        blocks: timed blocks per backend and size (the median is reported).
        target_s: time one block aims at (sets the calls per block).
        max_calls: bound on the calls per block.
        env: FREESCALE_* / UCX_* variables for the ranks.
    """

    world_size: int = 2
    min_bytes: int = 4 << 10
    max_bytes: int = 64 << 20
    factor: int = 2
    ops: tuple[str, ...] = OPS
    warmup: int = 5
    blocks: int = 10
    target_s: float = 0.05
    max_calls: int = 500
    env: dict[str, str] = field(default_factory=dict)

    def sizes(self) -> list[int]:
        """The sweep, ``min_bytes`` to ``max_bytes`` by ``factor``."""
        sizes, size = [], self.min_bytes
        while size <= self.max_bytes:
            sizes.append(size)
            size *= self.factor
        return sizes


def _rank_main(rank: int, config: BenchConfig, port: int, queue: Any) -> None:
    os.environ.update(config.env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    import freescale_comm

    torch.set_num_threads(1)
    freescale_comm.register()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "freescale", store=store, rank=rank, world_size=config.world_size,
        timeout=timedelta(seconds=120),
    )
    gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
    try:
        rows = [_measure(config, op, size, gloo) for op in config.ops for size in config.sizes()]
        if rank == 0:
            queue.put(("ok", rows))
    except BaseException as err:
        queue.put(("error", f"rank {rank}: {type(err).__name__}: {err}"))
        raise
    finally:
        dist.destroy_process_group()


def _calls(op: str, size: int, gloo: Any) -> tuple[int, dict[str, Callable[[], None]], Any]:
    """The per-backend calls of ``op`` at ``size``, their element count, and the outputs."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    elements = max(n, size // 4 // n * n)  # float32, divisible by n
    out = {name: torch.empty(elements) for name in BACKENDS}
    groups = {"freescale": None, "gloo": gloo}
    if op == "all_gather":
        data = torch.rand(elements // n, generator=torch.Generator().manual_seed(rank))

        def make(name: str) -> Callable[[], None]:
            return lambda: dist.all_gather_into_tensor(out[name], data, group=groups[name])
    else:
        data = torch.rand(elements, generator=torch.Generator().manual_seed(rank))

        def make(name: str) -> Callable[[], None]:
            return lambda: dist.all_to_all_single(out[name], data, group=groups[name])

    return elements, {name: make(name) for name in BACKENDS}, out


def _measure(config: BenchConfig, op: str, size: int, gloo: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    elements, calls, out = _calls(op, size, gloo)
    for call in calls.values():
        for _ in range(config.warmup):
            call()
    correct = bool(torch.equal(out["freescale"], out["gloo"]))
    # Calls per block from a second, warm pass (the first calls pay for connections and pages).
    warm = []
    for call in calls.values():
        dist.barrier(group=gloo)
        start = time.perf_counter()
        for _ in range(config.warmup):
            call()
        warm.append((time.perf_counter() - start) / config.warmup)
    per_call = _max_over_ranks([max(warm)], gloo)[0]
    count = max(1, min(config.max_calls, int(config.target_s / max(per_call, 1e-7))))
    mine: dict[str, list[float]] = {name: [] for name in BACKENDS}
    for block in range(config.blocks):
        order = BACKENDS if block % 2 == 0 else BACKENDS[::-1]
        for name in order:
            call = calls[name]
            dist.barrier(group=gloo)
            start = time.perf_counter()
            for _ in range(count):
                call()
            mine[name].append((time.perf_counter() - start) / count)
    slowest = _max_over_ranks([t for name in BACKENDS for t in mine[name]], gloo)
    nbytes = elements * 4
    row: dict[str, Any] = {"op": op, "size": nbytes, "world_size": n, "calls_per_block": count,
                           "correct": correct}
    for index, name in enumerate(BACKENDS):
        blocks = slowest[index * config.blocks : (index + 1) * config.blocks]
        seconds = statistics.median(blocks)
        algbw = nbytes / seconds / 1e9
        row[name] = {"time_us": seconds * 1e6, "min_us": min(blocks) * 1e6,
                     "max_us": max(blocks) * 1e6, "algbw": algbw, "busbw": algbw * (n - 1) / n}
    return row


def _max_over_ranks(values: list[float], group: Any) -> list[float]:
    """Element-wise maximum over the ranks of ``group`` (one reduction)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def run_bench(config: BenchConfig, timeout_s: float = 1800) -> dict[str, Any]:
    """Runs the sweep on ``config.world_size`` local processes; returns the report."""
    import torch
    import torch.distributed as dist

    import freescale_comm

    spawn = multiprocessing.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    queue = spawn.Queue()
    procs = [spawn.Process(target=_rank_main, args=(r, config, store.port, queue), daemon=True)
             for r in range(config.world_size)]
    for proc in procs:
        proc.start()
    try:
        kind, payload = queue.get(timeout=timeout_s)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    if kind != "ok":
        raise RuntimeError(f"benchmark failed: {payload}")
    from freescale_comm.transport import ucx_version

    return {
        "config": asdict(config),
        "method": "per size: warm-up, then blocks of back-to-back calls, freescale and Gloo "
                  "blocks alternating (ABBA), barrier only between blocks; time = median over "
                  "blocks of the slowest rank's time per call",
        "versions": {"freescale_comm": freescale_comm.__version__, "torch": torch.__version__,
                     "ucx": ucx_version()},
        "host": {"cpus": os.cpu_count(), "load_avg_1m_at_end": os.getloadavg()[0]},
        "rows": payload,
    }


def format_table(report: dict[str, Any]) -> str:
    """nccl-tests style columns, freescale beside Gloo."""
    head = (f"{'op':<11}{'ranks':>6}{'size(B)':>12}  {'fs time(us)':>12}{'algbw':>8}{'busbw':>8}"
            f"  {'gloo time(us)':>14}{'algbw':>8}{'busbw':>8}  {'fs/gloo':>8}  ok")
    lines = [head, "-" * len(head)]
    for row in report["rows"]:
        fs, gl = row["freescale"], row["gloo"]
        lines.append(
            f"{row['op']:<11}{row['world_size']:>6}{row['size']:>12}  {fs['time_us']:>12.1f}"
            f"{fs['algbw']:>8.2f}{fs['busbw']:>8.2f}  {gl['time_us']:>14.1f}{gl['algbw']:>8.2f}"
            f"{gl['busbw']:>8.2f}  {fs['time_us'] / gl['time_us']:>8.2f}  "
            f"{'yes' if row['correct'] else 'NO'}"
        )
    lines.append("bandwidths in GB/s; times: median over alternating blocks of the slowest "
                 "rank's time per call")
    return "\n".join(lines)


def write_report(report: dict[str, Any], out: Path) -> list[Path]:
    """Writes ``comm_bench_<n>ranks.json`` and, with matplotlib, a PNG beside it under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    n = report["config"]["world_size"]
    path = out / f"comm_bench_{n}ranks.json"
    path.write_text(json.dumps(report, indent=2))
    written = [path]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    ops = sorted({row["op"] for row in report["rows"]})
    fig, axes = plt.subplots(2, len(ops), figsize=(6 * len(ops), 8), squeeze=False)
    for col, op in enumerate(ops):
        rows = [r for r in report["rows"] if r["op"] == op]
        sizes = [r["size"] for r in rows]
        for name in BACKENDS:
            axes[0][col].plot(sizes, [r[name]["busbw"] for r in rows], marker="o", label=name)
            times = [r[name]["time_us"] for r in rows]
            spread = [[t - r[name]["min_us"] for t, r in zip(times, rows, strict=True)],
                      [r[name]["max_us"] - t for t, r in zip(times, rows, strict=True)]]
            axes[1][col].errorbar(sizes, times, yerr=spread, marker="o", capsize=2, label=name)
        axes[0][col].set_title(f"{op}, {n} ranks")
        axes[0][col].set_ylabel("busbw (GB/s)")
        axes[1][col].set_ylabel("time per call (us), bars: fastest..slowest block")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("bytes received per rank")
            ax.grid(True, alpha=0.3)
            ax.legend()
        axes[1][col].set_yscale("log")
    fig.tight_layout()
    png = out / f"comm_bench_{n}ranks.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    written.append(png)
    return written
