"""``freescale comm bench``: AllGather / AllToAll of freescale vs its peer, nccl-tests style.

Local ranks on loopback run every backend in the same processes (a freescale world and groups of
the other backends over the same ranks). On the CPU the peer is Gloo. With ``device="cuda"``
(rank r on GPU r mod the GPU count) freescale's IPC, direct and staged paths run, and NCCL
beside them where every rank has a GPU of its own (NCCL refuses two ranks on one GPU); results
are checked against Gloo's on CPU copies of the same data. Method, per size (as nccl-tests,
``doc/PERFORMANCE.md``):

1. warm-up calls of both backends (connections, caches, pages), then a correctness check of
   freescale's result against Gloo's;
2. calls per block from a second timed warm-up pass of the slower backend, so that a block lasts
   about ``target_s``, and at least ``min_calls`` (the same count for both backends, agreed
   across ranks): after the other backend's block the first two or three large calls of either
   backend take a few ms longer (caches refilled), which in a block of a few calls weighs on
   the faster backend's ratio;
3. ``blocks`` measurement blocks per backend, backends alternating (ABBA order, so that none
   always runs first after another), a barrier only between blocks: each rank times its own
   block of back-to-back calls, per call (on CUDA until the device is done with the block);
4. per block the slowest rank's time (one reduction at the end, none while measuring); the
   figure is the median over blocks, with the fastest and slowest block beside it.

Columns as nccl-tests: size is the bytes one rank receives (AllGather: the whole output;
AllToAll: the whole output of ``all_to_all_single``), algbw = size / time, busbw = algbw *
(n - 1) / n for both collectives.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from freescale_comm._local_ranks import GroupSpec, run_ranks

OPS = ("all_gather", "all_to_all")


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
        min_calls: calls per block at the least, however long they take (nccl-tests' default
            iteration count), so that a block's slow first calls weigh little.
        max_calls: bound on the calls per block.
        env: FREESCALE_* / UCX_* variables for the ranks.
        device: ``"cpu"`` or ``"cuda"`` tensors.
        threads: torch intra-op threads per rank; 0 leaves torch's default (one per core), as
            a training process has it: forcing one thread hid a cost of the backend that users
            saw (its large own-piece copy ran on torch's threads; ``CHANGELOG.md``).
        huge_pages: every rank's torch asks the kernel for transparent huge pages for its CPU
            tensors of 2 MiB and more (``THP_MEM_ALLOC_ENABLE=1``, both backends' tensors;
            off sets it to 0): their 2 MiB-aligned stretches first touched after that lie in
            2 MiB pages, which a peer's read pins in one step instead of 512; so freescale's
            one-host path reads messages above 512 KiB instead of carrying them through the
            rings (``shm_max_bytes=-1``). Rows record what the tensors got (``pages``).
    """

    world_size: int = 2
    min_bytes: int = 4 << 10
    max_bytes: int = 64 << 20
    factor: int = 2
    ops: tuple[str, ...] = OPS
    warmup: int = 5
    blocks: int = 10
    target_s: float = 0.05
    min_calls: int = 20
    max_calls: int = 500
    env: dict[str, str] = field(default_factory=dict)
    device: str = "cpu"
    threads: int = 0
    huge_pages: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"world_size must be at least 2, got {self.world_size}")
        if self.min_bytes <= 0 or self.max_bytes < self.min_bytes or self.factor < 2:
            raise ValueError("need 0 < min_bytes <= max_bytes and factor >= 2")
        if self.blocks < 1 or self.warmup < 1 or self.target_s <= 0:
            raise ValueError("blocks and warmup must be >= 1 and target_s > 0")
        if not 1 <= self.min_calls <= self.max_calls:
            raise ValueError(f"need 1 <= min_calls <= max_calls, got {self.min_calls}")

    def sizes(self) -> list[int]:
        """The sweep, ``min_bytes`` to ``max_bytes`` by ``factor``, each size rounded down to
        what is measured: whole float32 elements, as many for every rank (at least one); a size
        that rounds to one already in the sweep is left out."""
        unit = 4 * self.world_size
        sizes, size = [], self.min_bytes
        while size <= self.max_bytes:
            measured = max(unit, size // unit * unit)
            if measured not in sizes:
                sizes.append(measured)
            size *= self.factor
        return sizes

    def backends(self, gpus: int) -> tuple[str, ...]:
        """The backends compared, freescale's first, the peer last (``gpus``: GPUs present)."""
        if self.device == "cpu":
            return ("freescale", "gloo")
        own = ("freescale_ipc", "freescale_direct", "freescale_staged")
        return (*own, "nccl") if gpus >= self.world_size else own


def dist_all_gather_into_tensor() -> Callable[..., Any]:
    """``torch.distributed``'s AllGather into one tensor under this torch's name:
    ``all_gather_single`` in 2.13 (the old name warns there), ``all_gather_into_tensor`` in
    2.11."""
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _bench_rank(config: BenchConfig, progress: bool) -> dict[str, Any]:
    """One rank of ``run_bench``, in the launcher's freescale group: every row of the sweep
    (``progress``: rank 0 shows a bar of the (op, size) points on stderr), and the path the
    group's host bytes take to the next rank and why (the rings' limit and how it was chosen)."""
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from freescale_comm.options import FreescaleOptions

    gpus = torch.cuda.device_count() if config.device == "cuda" else 0
    timeout = timedelta(seconds=120)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    groups: dict[str, Any] = {"freescale": None, "freescale_direct": None, "gloo": gloo}
    names = config.backends(gpus)
    for name in names:
        if name in ("freescale_ipc", "freescale_staged"):
            groups[name] = dist.new_group(
                backend="freescale",
                timeout=timeout,
                pg_options=FreescaleOptions(cuda_path=name.removeprefix("freescale_")),
            )
    if "nccl" in names:
        groups["nccl"] = dist.new_group(backend="nccl", timeout=timeout)
    points = [(op, size) for op in config.ops for size in config.sizes()]
    shown = progress and dist.get_rank() == 0
    bar = tqdm(
        points, desc=f"comm bench, {config.world_size} ranks", disable=not shown, leave=False
    )
    rows = [_measure(config, op, size, {n: groups[n] for n in names}, gloo) for op, size in bar]
    world = dist.group.WORLD
    peer = (dist.get_rank() + 1) % config.world_size
    path = next(row for row in world.paths() if row["peer"] == peer)
    return {"rows": rows, "host_path": {"path": path["path"], "why": path["why"]}}


def _pages_of(addresses: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Per name, the memory mapping of this process that holds its address: whether it was
    advised for transparent huge pages (``hg`` in its ``VmFlags``: torch's ``madvise``,
    whatever the kernel then finds free) and how many KiB of the whole mapping lie in huge
    pages now (memory touched before the advice keeps its 4 KiB pages); ``None`` values where
    ``/proc/self/smaps`` does not say. One pass over the file."""
    found = {name: {"advised": None, "huge_kib": None} for name in addresses}
    inside: list[str] = []
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):  # "start-end perms ...": a mapping
                    start, _, end = head.partition("-")
                    low, high = int(start, 16), int(end, 16)
                    inside = [name for name, at in addresses.items() if low <= at < high]
                elif inside and head == "AnonHugePages:":
                    for name in inside:
                        found[name]["huge_kib"] = int(line.split()[1])
                elif inside and head == "VmFlags:":
                    for name in inside:
                        found[name]["advised"] = "hg" in line.split()[1:]
    except OSError:
        pass
    return found


def _calls(
    op: str, size: int, groups: dict[str, Any], device: str, gloo: Any
) -> tuple[int, dict[str, Callable[[], None]], dict[str, Any], Any, Any]:
    """Per backend: the call of ``op`` at ``size`` and its output; the element count, the
    expected output (Gloo's result on CPU copies of the same data) and the input."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    elements = size // 4  # ``BenchConfig.sizes``: whole float32 elements, divisible by n
    out = {name: torch.empty(elements, device=device) for name in groups}
    count = elements // n if op == "all_gather" else elements
    host = torch.rand(count, generator=torch.Generator().manual_seed(rank))
    data = host.to(device)
    want = torch.empty(elements)
    gather = dist_all_gather_into_tensor()
    collective = gather if op == "all_gather" else dist.all_to_all_single
    collective(want, host, group=gloo)

    def make(name: str) -> Callable[[], None]:
        return lambda: collective(out[name], data, group=groups[name])

    return elements, {name: make(name) for name in groups}, out, want, data


def _measure(
    config: BenchConfig, op: str, size: int, groups: dict[str, Any], gloo: Any
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    names = list(groups)
    elements, calls, out, want, data = _calls(op, size, groups, config.device, gloo)

    def done() -> None:
        if config.device == "cuda":
            torch.cuda.synchronize()

    for call in calls.values():
        for _ in range(config.warmup):
            call()
    done()
    mine_correct = all(bool(torch.equal(out[name].cpu(), want)) for name in names)
    # Every rank's check: the report keeps rank 0's rows.
    correct = _max_over_ranks([0.0 if mine_correct else 1.0], gloo)[0] == 0.0
    # Calls per block from a second, warm pass (the first calls pay for connections and pages).
    warm = []
    for call in calls.values():
        dist.barrier(group=gloo)
        start = time.perf_counter()
        for _ in range(config.warmup):
            call()
        done()
        warm.append((time.perf_counter() - start) / config.warmup)
    per_call = _max_over_ranks([max(warm)], gloo)[0]
    aimed = int(config.target_s / max(per_call, 1e-7))
    count = max(config.min_calls, min(config.max_calls, aimed))
    mine: dict[str, list[float]] = {name: [] for name in names}
    for block in range(config.blocks):
        for name in names if block % 2 == 0 else names[::-1]:
            call = calls[name]
            dist.barrier(group=gloo)
            start = time.perf_counter()
            for _ in range(count):
                call()
            done()
            mine[name].append((time.perf_counter() - start) / count)
    slowest = _max_over_ranks([t for name in names for t in mine[name]], gloo)
    nbytes = elements * 4
    row: dict[str, Any] = {
        "op": op,
        "size": nbytes,
        "world_size": n,
        "calls_per_block": count,
        "correct": correct,
        # The pages a peer's read pins (the input) and the reads or rings write (freescale's
        # output).
        "pages": _pages_of({"input": data.data_ptr(), "output": out[names[0]].data_ptr()})
        if config.device == "cpu"
        else None,
    }
    per_block = {
        name: slowest[index * config.blocks : (index + 1) * config.blocks]
        for index, name in enumerate(names)
    }
    # Each freescale block against the peer's block of the same round (adjacent in time): a
    # load that comes and goes moves both, so the ratio of the pair is steadier than the
    # ratio of the two medians.
    pairs = sorted(a / b for a, b in zip(per_block[names[0]], per_block[names[-1]], strict=True))
    row["paired_ratio"] = statistics.median(pairs)
    row["paired_ratio_range"] = [pairs[0], pairs[-1]]
    for index, name in enumerate(names):
        blocks = slowest[index * config.blocks : (index + 1) * config.blocks]
        seconds = statistics.median(blocks)
        algbw = nbytes / seconds / 1e9
        row[name] = {
            "time_us": seconds * 1e6,
            "min_us": min(blocks) * 1e6,
            "max_us": max(blocks) * 1e6,
            "algbw": algbw,
            "busbw": algbw * (n - 1) / n,
        }
    return row


def _max_over_ranks(values: list[float], group: Any) -> list[float]:
    """Element-wise maximum over the ranks of ``group`` (one reduction)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def run_bench(
    config: BenchConfig, timeout_s: float = 1800, progress: bool = False
) -> dict[str, Any]:
    """Runs the sweep on ``config.world_size`` local processes; returns the report.

    Args:
        config: what to measure.
        timeout_s: bound on the whole sweep.
        progress: rank 0 shows a progress bar of the (op, size) points on stderr.
    """
    import torch

    import freescale_comm
    from freescale_comm.info import transparent_huge_pages
    from freescale_comm.options import FreescaleOptions
    from freescale_comm.transport import ucx_version

    load_at_start = os.getloadavg()[0]
    spec = GroupSpec(
        config.world_size,
        "freescale",
        init_timeout_s=120.0,
        # torch reads it once, at its first CPU allocation: ranks set it before any (the fork
        # server that starts them allocates no tensor).
        env={**config.env, "THP_MEM_ALLOC_ENABLE": "1" if config.huge_pages else "0"},
        setup="freescale_comm:register",
        threads=config.threads or None,
        device=config.device,
        pg_options=FreescaleOptions(cuda_path="direct"),
    )
    # Every rank measures every row; rank 0's are reported (the times are maxima over ranks).
    payload = run_ranks(spec, _bench_rank, config, progress, timeout_s=timeout_s)[0]

    gpus = torch.cuda.device_count() if config.device == "cuda" else 0
    return {
        "config": asdict(config),
        "backends": list(config.backends(gpus)),
        "method": "per size: warm-up, then blocks of back-to-back calls, the backends' blocks "
        "interleaved in the same processes, "
        "alternating (ABBA), barrier only between blocks; time = median over blocks of "
        "the slowest rank's time per call (on CUDA until the device is done)",
        "versions": {
            "freescale_comm": freescale_comm.__version__,
            "torch": torch.__version__,
            "ucx": ucx_version(),
        },
        "host": {
            "cpus": os.cpu_count(),
            "load_avg_1m_at_start": load_at_start,
            "load_avg_1m_at_end": os.getloadavg()[0],
            "gpus": gpus,
            "transparent_huge_pages": transparent_huge_pages(),
        },
        "host_path": payload["host_path"],
        "rows": payload["rows"],
    }


def format_table(report: dict[str, Any]) -> str:
    """nccl-tests style columns, one group per backend; the ratio of freescale's time to the
    peer's (the last backend)."""
    names = report["backends"]
    short = {
        "freescale": "fs",
        "freescale_ipc": "ipc",
        "freescale_direct": "direct",
        "freescale_staged": "staged",
    }
    ratio = f"{short.get(names[0], names[0])}/{short.get(names[-1], names[-1])}"
    head = f"{'op':<11}{'ranks':>6}{'size(B)':>12}"
    for name in names:
        head += f"  {short.get(name, name) + ' time(us)':>16}{'algbw':>8}{'busbw':>8}"
    head += f"  {ratio:>13}  {'paired':>7}  ok"
    lines = [head, "-" * len(head)]
    for row in report["rows"]:
        line = f"{row['op']:<11}{row['world_size']:>6}{row['size']:>12}"
        for name in names:
            r = row[name]
            line += f"  {r['time_us']:>16.1f}{r['algbw']:>8.2f}{r['busbw']:>8.2f}"
        line += (
            f"  {row[names[0]]['time_us'] / row[names[-1]]['time_us']:>13.2f}  "
            f"{row.get('paired_ratio', float('nan')):>7.2f}  "
            f"{'yes' if row['correct'] else 'NO'}"
        )
        lines.append(line)
    lines.append(
        "bandwidths in GB/s; times: median over alternating blocks of the slowest "
        "rank's time per call; paired: median over rounds of the ratio of a round's two blocks"
    )
    if "host_path" in report:
        host = report["host_path"]
        lines.append(f"freescale's host bytes to the next rank: {host['path']} ({host['why']})")
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
        for name in report["backends"]:
            axes[0][col].plot(sizes, [r[name]["busbw"] for r in rows], marker="o", label=name)
            times = [r[name]["time_us"] for r in rows]
            spread = [
                [t - r[name]["min_us"] for t, r in zip(times, rows, strict=True)],
                [r[name]["max_us"] - t for t, r in zip(times, rows, strict=True)],
            ]
            axes[1][col].errorbar(sizes, times, yerr=spread, marker="o", capsize=2, label=name)
        axes[0][col].set_title(f"{op}, {n} ranks, {report['config'].get('device', 'cpu')}")
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
