"""``freescale embed bench``: exposed embedding communication per step, sync vs prioritized.

The bench starts ``world_size`` local ranks itself (a TCPStore on loopback; Gloo, or the
``freescale`` backend), and for each collision rate trains the same synthetic steps once in each
mode: embedding forward, a simulated dense compute (a sleep or CPU matmuls; on CUDA, bf16 matmuls
on the training stream that the training thread waits for), backward through the embeddings, and
optionally a dense optimizer step (a real Adam over ``optimizer_params`` parameters: the work a
training loop does between a backward and the next forward).
It reports the median over the timed steps of the training thread's exposed embedding
communication (``StepTelemetry``), the step time, the bytes moved, the prefetch memory, and
whether the two modes ended with bitwise the same tables and optimizer state.

Exposed communication is time a rank's training thread is blocked in an embedding collective or
waiting for the prefetch thread. A rank that reaches a collective first also waits there for its
slowest peer's local work (or for the scheduler, on a shared machine), so each step is reported
twice: the mean over ranks (what training sees) and the collectives' time after the last rank
joined each (the communication itself; the ranks share one host, hence one monotonic clock).
Ranks are aligned by an uncounted barrier (on a Gloo group) before backward, and run the steps
back to back otherwise: nothing uncounted lies between a backward and the next forward, where
prioritized mode's collision AllToAll is in flight.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from tqdm import tqdm

from freescale_balance import JaggedBatch, JaggedTensor
from freescale_embed._local_ranks import GroupSpec, run_ranks, run_reporting_ranks
from freescale_embed.collection import ShardedEmbeddingCollection
from freescale_embed.config import TableConfig
from freescale_embed.optim import RowWiseAdagrad
from freescale_embed.workload import WorkloadConfig, make_batch


@dataclass(frozen=True)
class BenchConfig:
    """What the bench runs.

    Attributes:
        world_size: local ranks.
        collision_rates: shares of each step's rows that the previous step also read.
        steps: timed steps per (rate, mode), after ``warmup`` untimed ones.
        warmup: untimed steps first.
        num_embeddings: rows of the one table.
        embedding_dim: width of a row.
        rows_per_step: unique rows per step over all ranks.
        batch_size: samples per rank (the IDs are split over them).
        dense: simulated dense compute between forward and backward: ``"sleep"`` (the CPU is
            free, as when a GPU computes), ``"matmul"`` (the CPU is busy) or ``"gpu"`` (bf16
            matmuls of ``matmul_size`` on the training stream, as many as last ``dense_ms``
            with every rank computing; the training thread waits for them).
        dense_ms: length of a sleep or of the GPU matmuls.
        matmul_size: side of the square matmuls of ``"matmul"``.
        matmul_repeats: matmuls per step.
        optimizer_params: dense parameters updated by an Adam step after every backward (fused
            on CUDA, where the training thread then waits for the GPU); 0: no such step.
        threads: intra-op threads per rank.
        seed: workload seed.
        device: ``"cpu"`` or ``"cuda"`` (rank r uses GPU ``r % device count``).
        backend: process group backend of the embedding collectives (``"gloo"``,
            ``"freescale"``, ``"nccl"``).
    """

    world_size: int = 2
    collision_rates: tuple[float, ...] = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)
    steps: int = 20
    warmup: int = 3
    num_embeddings: int = 500_000
    embedding_dim: int = 128
    rows_per_step: int = 65_536
    batch_size: int = 64
    dense: Literal["sleep", "matmul", "gpu"] = "sleep"
    dense_ms: float = 250.0
    matmul_size: int = 512
    matmul_repeats: int = 8
    optimizer_params: int = 0
    threads: int = 1
    seed: int = 0
    device: Literal["cpu", "cuda"] = "cpu"
    backend: Literal["gloo", "freescale", "nccl"] = "gloo"

    def __post_init__(self) -> None:
        at_least = {
            "world_size": 1,
            "steps": 1,
            "warmup": 0,
            "num_embeddings": 1,
            "embedding_dim": 1,
            "rows_per_step": 1,
            "batch_size": 1,
            "matmul_size": 1,
            "matmul_repeats": 1,
            "optimizer_params": 0,
            "threads": 1,
        }
        for name, minimum in at_least.items():
            if getattr(self, name) < minimum:
                raise ValueError(f"{name} must be at least {minimum}, got {getattr(self, name)}")
        if not self.collision_rates or not all(0 <= r <= 1 for r in self.collision_rates):
            raise ValueError(f"collision_rates must be in [0, 1], got {self.collision_rates}")
        # Step t+1 draws its rows outside step t's where they do not collide.
        if self.num_embeddings < 2 * self.rows_per_step:
            raise ValueError(
                f"num_embeddings ({self.num_embeddings}) must be at least twice rows_per_step "
                f"({self.rows_per_step}): a step's new rows come from outside the previous step's"
            )
        if self.dense_ms < 0:
            raise ValueError(f"dense_ms must be >= 0, got {self.dense_ms}")
        if self.dense == "gpu" and self.device != "cuda":
            raise ValueError("dense 'gpu' needs device 'cuda'")

    def table(self) -> TableConfig:
        return TableConfig("items", self.num_embeddings, self.embedding_dim, ["history"])


class _Dense:
    """The simulated dense compute of one rank (see ``BenchConfig.dense``)."""

    def __init__(self, config: BenchConfig, device: torch.device, control: Any) -> None:
        self.config = config
        generator = torch.Generator().manual_seed(config.seed + dist.get_rank())
        size = config.matmul_size
        self.state = torch.randn(size, size, generator=generator) / size**0.5
        self.repeats = config.matmul_repeats
        if config.dense == "gpu":
            self.state = self.state.to(device, torch.bfloat16)
            self.repeats = self._calibrate(control)
        self.optimizer: torch.optim.Adam | None = None
        if config.optimizer_params:
            parameters = torch.zeros(config.optimizer_params, device=device, requires_grad=True)
            parameters.grad = torch.randn(config.optimizer_params, generator=generator).to(device)
            self.optimizer = torch.optim.Adam(
                [parameters], lr=1e-4, fused=True if device.type == "cuda" else None
            )

    def _calibrate(self, control: Any) -> int:
        """Matmuls per step so that they last ``dense_ms`` while every rank computes at once."""
        trial = 20
        for _ in range(2):
            dist.barrier(group=control)
            torch.cuda.synchronize()
            started = time.perf_counter()
            self._matmuls(trial)
            torch.cuda.synchronize()
            seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=control)
        return max(1, round(self.config.dense_ms / 1000.0 / (float(seconds) / trial)))

    def _matmuls(self, count: int) -> None:
        for _ in range(count):
            self.state = torch.tanh(self.state @ self.state) * 0.5

    def run(self) -> None:
        """Computes one step's dense part and returns when it is done."""
        if self.config.dense == "sleep":
            time.sleep(self.config.dense_ms / 1000.0)
            return
        self._matmuls(self.repeats)
        if self.config.dense == "gpu":
            # The training thread waits for the GPU, as a real step's does before backward.
            torch.cuda.current_stream().synchronize()

    def step_optimizer(self) -> None:
        """The dense optimizer step after a backward (if configured); returns when it is done."""
        if self.optimizer is None:
            return
        self.optimizer.step()
        if self.config.device == "cuda":
            torch.cuda.current_stream().synchronize()


def on_device(batch: JaggedBatch, device: torch.device) -> JaggedBatch:
    """``batch``'s features with IDs and lengths on ``device``."""
    features = {
        name: JaggedTensor(f.values.to(device), f.lengths.to(device))
        for name, f in batch.features.items()
    }
    return JaggedBatch(features=features)


def _run_mode(
    config: BenchConfig,
    rate: float,
    mode: str,
    device: torch.device,
    control: Any,
    dense: _Dense,
    bar: tqdm,
) -> dict[str, Any]:
    rank = dist.get_rank()
    table = config.table()
    workload = WorkloadConfig(
        tables=(table,),
        world_size=config.world_size,
        batch_size=config.batch_size,
        rows_per_step=config.rows_per_step,
        collision_rate=rate,
        seed=config.seed,
    )
    total = config.warmup + config.steps + 1  # the last step is final: not timed
    batches = [on_device(make_batch(workload, rank, step), device) for step in range(total)]
    emb = ShardedEmbeddingCollection(
        [table], optimizer=RowWiseAdagrad(lr=0.05), mode=mode, device=device
    )
    # Seeded, so that both modes see the same losses and must end with the same bits.
    generator = torch.Generator().manual_seed(config.seed + rank + 1)
    weights = torch.randn(config.embedding_dim, generator=generator).to(device)
    step_times, optimizer_times = [], []
    dist.barrier(group=control)
    for step in range(total):
        started = time.perf_counter()
        if mode == "sync":
            out = emb(batches[step])
        else:
            last = step + 1 == total
            out = emb(batches[step], None if last else batches[step + 1], final=last)
        dense.run()
        loss = (out["history"].values * weights).sum()
        # Ranks start backward together (an uncounted barrier), so that the dense compute's
        # different lengths on the ranks do not show up as waits in the gradient collectives.
        paused = time.perf_counter()
        dist.barrier(group=control)
        resumed = time.perf_counter()
        loss.backward()
        optimized = time.perf_counter()
        dense.step_optimizer()
        optimizer_times.append(time.perf_counter() - optimized)
        step_times.append(time.perf_counter() - started - (resumed - paused))
        bar.update()
    emb.synchronize()
    timed = [t.as_dict() for t in emb.telemetry][config.warmup : config.warmup + config.steps]
    state_dict = {k: v.clone() for k, v in emb.state_dict().items()}
    emb.close()
    return {
        "exposed_s": [t["exposed_comm_s"] for t in timed],
        "prefetch_wait_s": [t["prefetch_wait_s"] for t in timed],
        "spans": [t["collective_spans"] for t in timed],
        "background_s": [t["background_comm_s"] for t in timed],
        "bytes": [t["bytes_sent"] for t in timed],
        "prefetch_bytes": [t["prefetch_bytes"] for t in timed],
        "collision_pct": [t["collision_pct"] for t in timed],
        "fallback": [t["lookup"] == "fallback" for t in timed],
        "step_s": step_times[config.warmup : config.warmup + config.steps],
        "optimizer_s": optimizer_times[config.warmup : config.warmup + config.steps],
        "dense_repeats": dense.repeats,
        "state": state_dict,
    }


def rank_results(
    config: BenchConfig, device: torch.device, control: Any, progress: bool = False
) -> list[dict[str, Any]]:
    """This rank's measurements of every (rate, mode), in an initialized process group.

    Args:
        config: what to run.
        device: this rank's device.
        control: a Gloo group for the bench's own barriers (``None``: the default group).
        progress: show a progress bar of the steps on stderr.
    """
    results = []
    # Calibrated once: both modes of every rate run the same dense compute.
    dense = _Dense(config, device, control)
    steps = 2 * len(config.collision_rates) * (config.warmup + config.steps + 1)
    bar = tqdm(total=steps, desc="embed bench", unit="step", disable=not progress, leave=False)
    for rate in config.collision_rates:
        bar.set_postfix_str(f"collision rate {rate:g}")
        sync = _run_mode(config, rate, "sync", device, control, dense, bar)
        prioritized = _run_mode(config, rate, "prioritized", device, control, dense, bar)
        exact = all(
            torch.equal(value, prioritized["state"][key]) for key, value in sync["state"].items()
        )
        del sync["state"], prioritized["state"]
        results.append(
            {"collision_rate": rate, "sync": sync, "prioritized": prioritized, "exact": exact}
        )
    bar.close()
    return results


def rank_device(config: BenchConfig, rank: int) -> torch.device:
    """The device of ``rank``: GPU ``rank % device count`` (made current) or the CPU."""
    if config.device != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def _bench_rank(config: BenchConfig, progress: bool) -> list[dict[str, Any]]:
    """One rank of ``run_bench``, in the launcher's process group."""
    rank = dist.get_rank()
    device = rank_device(config, rank)
    control = None if config.backend == "gloo" else dist.new_group(backend="gloo")
    return rank_results(config, device, control, progress and rank == 0)


def _after_last_arrival(spans_of_ranks: tuple[list[tuple[float, float]], ...]) -> float:
    """Seconds the step's collectives took once every rank had joined each of them.

    A rank that joins a collective early waits there for its peers' local work; what remains
    after the last rank joined (until the first rank leaves) is the communication itself.
    """
    total = 0.0
    for spans in zip(*spans_of_ranks, strict=True):
        total += max(0.0, min(end for _, end in spans) - max(start for start, _ in spans))
    return total


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode at one rate: per step over ranks, then the median over steps."""

    def per_step(key: str, over_ranks: Any) -> list[float]:
        return [over_ranks(values) for values in zip(*(r[key] for r in runs), strict=True)]

    collisions = [c for c in runs[0]["collision_pct"] if c is not None]
    return {
        # What a rank's training thread waits (averaged over ranks), and the collectives' time
        # after every rank had joined them (the waiting for a peer's local work removed).
        "exposed_ms": 1000 * statistics.median(per_step("exposed_s", statistics.fmean)),
        # The part of it spent waiting for the prefetch thread (the rest: collectives).
        "prefetch_wait_ms": 1000 * statistics.median(per_step("prefetch_wait_s", statistics.fmean)),
        "collective_ms": 1000 * statistics.median(per_step("spans", _after_last_arrival)),
        "background_ms": 1000 * statistics.median(per_step("background_s", statistics.fmean)),
        # A step lasts as long as its slowest rank.
        "step_ms": 1000 * statistics.median(per_step("step_s", max)),
        "optimizer_ms": 1000 * statistics.median(per_step("optimizer_s", statistics.fmean)),
        "mb_per_step": statistics.median(per_step("bytes", statistics.fmean)) / 1e6,
        "prefetch_mb": max(max(r["prefetch_bytes"]) for r in runs) / 1e6,
        "collision_pct": statistics.median(collisions) if collisions else None,
        "fallback_steps": sum(runs[0]["fallback"]),
        "per_rank_exposed_ms": [1000 * statistics.median(r["exposed_s"]) for r in runs],
    }


def _combine(config: BenchConfig, per_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The report: per collision rate, each mode's summary over ranks and steps."""
    points = []
    for index, rate in enumerate(config.collision_rates):
        rows = [ranks[index] for ranks in per_rank]
        point: dict[str, Any] = {"collision_rate": rate, "exact": all(r["exact"] for r in rows)}
        for mode in ("sync", "prioritized"):
            point[mode] = _summary([r[mode] for r in rows])
        sync, prioritized = point["sync"], point["prioritized"]
        point["ratio"] = prioritized["exposed_ms"] / sync["exposed_ms"]
        point["ratio_collective"] = prioritized["collective_ms"] / sync["collective_ms"]
        points.append(point)
    return {
        "config": asdict(config),
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "backend": f"{config.backend} (loopback)",
            "device": config.device,
        },
        "points": points,
    }


def launch_ranks(
    target: Callable[..., None],
    world_size: int,
    args: tuple[Any, ...],
    timeout_s: float,
    stop_on_error: bool = False,
) -> dict[int, tuple[str, Any]]:
    """Runs ``target(rank, port, queue, *args)`` on ``world_size`` local ranks of the one
    launcher (``_local_ranks``); each rank joins its group itself on the launcher's store
    (``port``) and reports one ``(rank, kind, payload)`` on ``queue``.

    Returns:
        ``(kind, payload)`` by rank, ``kind`` ``"ok"``, ``"error"``, ``"timeout"`` or ``"died"``;
        with ``stop_on_error`` the ranks not waited for once one failed are left out.
    """
    replies = run_reporting_ranks(target, world_size, args, timeout_s, stop_on_error=stop_on_error)
    return {rank: tuple(items[-1][-2:]) for rank, items in replies.items() if items}


def run_bench(
    config: BenchConfig, timeout_s: float = 1800.0, progress: bool = False
) -> dict[str, Any]:
    """Starts the ranks, runs every (rate, mode) and returns the combined report.

    Args:
        config: what to run.
        timeout_s: bound on the whole run; ranks still running then are killed.
        progress: rank 0 shows a progress bar of the steps on stderr.

    Raises:
        RankFailure: a rank raised, timed out or died (every rank's traceback in the message).
    """
    load_before = os.getloadavg()
    spec = GroupSpec(
        config.world_size,
        config.backend,
        init_timeout_s=300.0,
        setup="freescale_comm:register" if config.backend == "freescale" else None,
        threads=config.threads,
        device=config.device,
    )
    per_rank = run_ranks(spec, _bench_rank, config, progress, timeout_s=timeout_s)
    report = _combine(config, per_rank)
    # The machine may be shared: its load says how much the timings can be trusted.
    report["environment"]["load_average_1min"] = [load_before[0], os.getloadavg()[0]]
    return report


def format_table(report: dict[str, Any]) -> str:
    """The report as a text table, one line per collision rate."""
    lines = [
        "collision %  exposed ms: sync  prioritized  ratio | after last arrival: sync  prioritized"
        "  ratio"
        " | step ms: sync  prioritized | optimizer ms: sync  prioritized | MB/step  prefetch MB"
        "  exact"
    ]
    for point in report["points"]:
        sync, prio = point["sync"], point["prioritized"]
        measured = prio.get("collision_pct") or 100 * point["collision_rate"]
        lines.append(
            f"{measured:>11.1f}  {sync['exposed_ms']:>16.2f}  {prio['exposed_ms']:>11.2f}  "
            f"{point['ratio']:>5.3f} | {sync['collective_ms']:>24.2f}  "
            f"{prio['collective_ms']:>11.2f}  {point['ratio_collective']:>5.3f} | "
            f"{sync['step_ms']:>13.1f}  {prio['step_ms']:>11.1f} | {sync['optimizer_ms']:>18.2f}  "
            f"{prio['optimizer_ms']:>11.2f} | "
            f"{sync['mb_per_step']:>7.2f}  "
            f"{prio['prefetch_mb']:>11.2f}  {'yes' if point['exact'] else 'NO'}"
        )
    return "\n".join(lines)


def write_report(report: dict[str, Any], out: Path) -> list[Path]:
    """Writes ``embed_bench.json`` and, with matplotlib, ``embed_bench.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "embed_bench.json"]
    written[0].write_text(json.dumps(report, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    points = report["points"]
    rates = [p["prioritized"].get("collision_pct") or 100 * p["collision_rate"] for p in points]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, marker in (("sync", "o"), ("prioritized", "s")):
        line = left.plot(
            rates, [p[mode]["exposed_ms"] for p in points], marker + "-", label=f"{mode} (mean)"
        )
        left.plot(
            rates,
            [p[mode]["collective_ms"] for p in points],
            marker + ":",
            color=line[0].get_color(),
            label=f"{mode} (after last arrival)",
        )
    left.set_xlabel("collision rate (% of a step's rows read by the previous step)")
    left.set_ylabel("exposed embedding communication per step (ms)")
    left.legend()
    left.grid(alpha=0.3)
    right.plot(rates, [p["ratio"] for p in points], "s-", color="tab:orange", label="mean")
    right.plot(
        rates,
        [p["ratio_collective"] for p in points],
        "s:",
        color="tab:orange",
        label="after last arrival",
    )
    right.axhline(1 / 9, color="gray", linestyle="--", label="1/9 (target at <= 5%)")
    right.set_xlabel("collision rate (%)")
    right.set_ylabel("prioritized / sync exposed communication")
    right.legend()
    right.grid(alpha=0.3)
    config = report["config"]
    figure.suptitle(
        f"{config['world_size']} ranks, {config['backend']} on loopback, {config['device']}, "
        f"{config['rows_per_step']} rows/step x {config['embedding_dim']} floats, "
        f"dense: {config['dense']}"
    )
    figure.tight_layout()
    written.append(out / "embed_bench.png")
    figure.savefig(written[-1], dpi=120)
    plt.close(figure)
    return written
