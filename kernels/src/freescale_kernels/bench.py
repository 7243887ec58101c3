"""``freescale kernels bench``: latency of Triton kernels vs eager references over world sizes.

For each operation, input case and world size, every provider is timed on the same inputs:
``triton`` (the kernels), ``reference`` (the best vectorized eager PyTorch) and, for the
rank-dependent operations on the base cases, ``naive`` (a per-rank Python loop, labelled as such
everywhere). Times, all medians:

* ``ms``: an eager call, as a training step issues it (``triton.testing.do_bench``, L2 flushed
  between calls): GPU time, or the host's launch overhead when that is longer.
* ``gpu_ms`` (CUDA only): the same call captured once in a CUDA graph and replayed (L2 flushed
  between replays), i.e. the GPU time of its kernels with the host out of the way. Operations
  that sync with the host (``unique_with_inverse``) cannot be captured and have none.
* ``host_ms`` (CUDA only): wall time to enqueue one call without waiting for the GPU.
* ``plan_gpu_ms`` / ``copy_gpu_ms`` (Triton, data-movement operations): the planning launches
  (sorting ranks, running sums) and the copy kernel, each captured and replayed alone.

On CPU ``ms`` is the median of wall-clock repeats. Achieved GB/s counts the bytes an ideal
implementation must move (values read once and written once) and is compared with a
device-to-device ``copy_`` measured in the same run. A provider that fails is recorded with its
error and the run goes on; the JSON and the table are always written. ``profile=True`` adds a
torch.profiler summary (kernels, their GPU time, launch gaps) of each Triton operation on the
largest case.

Inputs: ``local_batch`` samples of ``num_keys`` keys whose lengths are log-normal (median
``max_length / 8 / 4**key``, capped at ``max_length``, 5% empty), the same at every world size;
each sample gets a uniform random destination rank. Cases: ``ids`` (1-D int64 IDs) and ``rows``
(``[N, embedding_dim]`` bf16 rows with lengths 16x shorter, like embedding AllToAlls), and the
same with ``large_batch`` samples (``ids-large``, ``rows-large``; 4x the data at the defaults,
138 and 276 MB of values) at ``large_world_sizes``, so that "large inputs" are well past the L2.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from freescale_kernels import api
from freescale_kernels._backend import interpreting, triton_available
from freescale_kernels.layout import Dispatched, JaggedTensor
from freescale_kernels.ops import naive
from freescale_kernels.tiles import TUNED, Tiles

OPS = (
    "jagged_index_select",
    "ranged_dispatch",
    "ranged_combine",
    "keyed_transpose",
    "unique_with_inverse",
    "segment_sum",
)
PROVIDERS = ("triton", "reference", "naive")
NAIVE_OPS = ("ranged_dispatch", "ranged_combine", "keyed_transpose")
# Operations that wait for the host (an output size): no CUDA-graph capture.
HOST_SYNC_OPS = ("unique_with_inverse",)
# Operations whose Triton version is a plan plus one copy: their time is also split in two.
SPLIT_OPS = ("jagged_index_select", "ranged_dispatch", "ranged_combine", "keyed_transpose")
CASES = ("ids", "rows", "ids-large", "rows-large")
# Operations measured on one kind of case only: dedup works on IDs, gradient sums on rows.
ONLY_KIND = {"unique_with_inverse": "ids", "segment_sum": "rows"}
_ROWS_LENGTH_DIVISOR = 16


def case_kind(case: str) -> str:
    """``ids`` or ``rows``."""
    return case.split("-")[0]


def is_large(case: str) -> bool:
    return case.endswith("-large")


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. ``quick()`` gives sizes that run in seconds on a CPU."""

    world_sizes: tuple[int, ...] = (8, 32, 128, 512)
    local_batch: int = 1024
    large_batch: int = 4096  # 0: no large cases
    large_world_sizes: tuple[int, ...] = (8, 512)
    num_keys: int = 4
    max_length: int = 16384
    embedding_dim: int = 128
    segment_rows_per_sample: int = 256
    ops: tuple[str, ...] = OPS
    providers: tuple[str, ...] = PROVIDERS
    check: bool = False
    seed: int = 0
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")
    warmup_ms: int = 25
    rep_ms: int = 100
    graphs: bool = True  # gpu_ms, host_ms and the plan / copy split, on CUDA
    profile: bool = False
    tiles: Tiles = TUNED

    @classmethod
    def quick(cls, **overrides: Any) -> BenchConfig:
        small = cls(
            world_sizes=(2, 8, 32),
            local_batch=64,
            large_batch=128,
            large_world_sizes=(32,),
            num_keys=2,
            max_length=256,
            embedding_dim=16,
            segment_rows_per_sample=16,
            rep_ms=20,
        )
        return replace(small, **overrides)


@dataclass
class Inputs:
    """One case at one world size, with everything each operation reads."""

    values: torch.Tensor
    lengths: torch.Tensor
    ranks: torch.Tensor
    sent: Dispatched
    ids: torch.Tensor
    segment_rows: torch.Tensor
    segment_offsets: torch.Tensor
    segment_order: torch.Tensor


def batch_of(config: BenchConfig, case: str) -> int:
    return config.large_batch if is_large(case) else config.local_batch


def world_sizes_of(config: BenchConfig, case: str) -> tuple[int, ...]:
    return config.large_world_sizes if is_large(case) else config.world_sizes


def cases_of(config: BenchConfig) -> tuple[str, ...]:
    return CASES if config.large_batch else CASES[:2]


def _lengths(config: BenchConfig, batch: int, divisor: int, gen: torch.Generator) -> torch.Tensor:
    rows = []
    for key in range(config.num_keys):
        median = max(config.max_length / 8 / 4**key / divisor, 1.0)
        sample = torch.empty(batch).log_normal_(math.log(median), 1.0, generator=gen)
        sample = sample.clamp(0, config.max_length // divisor).round()
        sample[torch.rand(batch, generator=gen) < 0.05] = 0
        rows.append(sample)
    return torch.stack(rows).to(torch.int64)


def make_case(config: BenchConfig, case: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, lengths ``[F, B]``) of ``case``, identical at every world size."""
    gen = torch.Generator().manual_seed(config.seed)
    device = torch.device(config.device)
    batch = batch_of(config, case)
    if case_kind(case) == "ids":
        lengths = _lengths(config, batch, 1, gen)
        values = torch.randint(0, 2**40, (int(lengths.sum()),), generator=gen)
        return values.to(device), lengths.to(device)
    lengths = _lengths(config, batch, _ROWS_LENGTH_DIVISOR, gen)
    rows = int(lengths.sum())
    values = torch.randn(rows, config.embedding_dim, device=device, dtype=torch.bfloat16)
    return values, lengths.to(device)


def make_inputs(
    config: BenchConfig, values: torch.Tensor, lengths: torch.Tensor, world_size: int
) -> Inputs:
    gen = torch.Generator().manual_seed(config.seed + world_size)
    device = values.device
    batch = lengths.shape[1]
    ranks = torch.randint(0, world_size, (batch,), generator=gen).to(device)
    sent = api.ranged_dispatch(values, lengths, ranks, world_size, backend="reference")
    # Embedding-style IDs with repeats: the first key's IDs folded onto a smaller vocabulary.
    key0 = values[: int(lengths[0].sum())] if values.dim() == 1 else values.new_zeros(0)
    ids = key0.to(torch.int64).remainder(max(key0.numel() // 4, 1))
    segment_count = batch * config.segment_rows_per_sample
    segment_ids = torch.randint(0, max(segment_count // 4, 1), (segment_count,), generator=gen)
    unique = api.unique_with_inverse(segment_ids, backend="reference")
    rows_gen = torch.Generator(device=device).manual_seed(config.seed + world_size)
    rows = torch.randn(segment_count, config.embedding_dim, generator=rows_gen, device=device)
    return Inputs(
        values,
        lengths,
        ranks,
        sent,
        ids,
        rows,
        unique.offsets.to(device),
        unique.order.to(device),
    )


def _call(op: str, inputs: Inputs, provider: str, tiles: Tiles = TUNED) -> Callable[[], Any]:
    """A zero-argument call of ``op`` by ``provider`` (Triton with ``tiles``)."""
    x, sent, world = inputs, inputs.sent, inputs.sent.rank_splits.numel()
    keys = x.lengths.shape[0]
    if provider == "naive":
        calls: dict[str, Callable[[], Any]] = {
            "ranged_dispatch": lambda: naive.ranged_dispatch(x.values, x.lengths, x.ranks, world),
            "ranged_combine": lambda: naive.ranged_combine(
                sent.values, sent.lengths, x.ranks, keys
            ),
            "keyed_transpose": lambda: naive.keyed_transpose(
                sent.values, sent.lengths, sent.sample_counts, keys
            ),
        }
        return calls[op]
    b, t = provider, tiles
    calls = {
        "jagged_index_select": lambda: api.jagged_index_select(
            x.values, x.lengths, sent.order, output_size=x.values.shape[0], backend=b, tiles=t
        ),
        "ranged_dispatch": lambda: api.ranged_dispatch(
            x.values, x.lengths, x.ranks, world, backend=b, tiles=t
        ),
        "ranged_combine": lambda: api.ranged_combine(
            sent.values, sent.lengths, x.ranks, keys, backend=b, tiles=t
        ),
        "keyed_transpose": lambda: api.keyed_transpose(
            sent.values, sent.lengths, sent.sample_counts, keys, backend=b, tiles=t
        ),
        "unique_with_inverse": lambda: api.unique_with_inverse(x.ids, backend=b),
        "segment_sum": lambda: api.segment_sum(
            x.segment_rows, x.segment_offsets, order=x.segment_order, backend=b, tiles=t
        ),
    }
    return calls[op]


def _split_calls(
    op: str, inputs: Inputs, tiles: Tiles
) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(plan, copy) of the Triton ``op``: zero-argument calls of each half alone."""
    from freescale_kernels.layout import as_rows
    from freescale_kernels.ops import index_select, jagged_copy, ranged

    x, sent = inputs, inputs.sent
    keys, batch = x.lengths.shape
    world = sent.rank_splits.numel()
    rows = x.values.shape[0]
    if op == "jagged_index_select":
        index = sent.order

        def plan() -> Any:
            return index_select.plan_select(x.lengths.reshape(-1), keys, batch, index)

        _, _, out_offsets, src_starts = plan()
        values = as_rows(x.values)
        return plan, lambda: jagged_copy.gather_segments(
            values, out_offsets, src_starts, rows, tile=tiles.copy
        )
    if op == "ranged_dispatch":
        source = x.values

        def plan() -> Any:
            return ranged.plan_dispatch(x.lengths, x.ranks, world, rows)

        layout = plan()[0]
    elif op == "ranged_combine":
        source = sent.values

        def plan() -> Any:
            return ranged.plan_combine(sent.lengths, x.ranks, keys, rows)

        layout = plan()
    else:
        source = sent.values

        def plan() -> Any:
            return ranged.plan_transpose(
                sent.lengths, sent.sample_counts, keys, rows, to_key_major=True
            )

        layout = plan()[0]
    return plan, lambda: ranged.move(source, layout, tiles.copy)


def _graph_ms(fn: Callable[[], Any], config: BenchConfig) -> float:
    """Median GPU time of ``fn`` captured in a CUDA graph, L2 flushed before each replay."""
    from triton.testing import do_bench

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles and warms up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        return float(
            do_bench(graph.replay, warmup=config.warmup_ms, rep=config.rep_ms, return_mode="median")
        )
    finally:
        del graph
        torch.cuda.synchronize()


def _host_ms(fn: Callable[[], Any], calls: int = 20) -> float:
    """Wall time to enqueue one call of ``fn`` without waiting for the GPU."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1000


def _bytes_moved(op: str, inputs: Inputs) -> int:
    """Bytes an ideal implementation reads plus writes (index metadata not counted)."""
    if op == "unique_with_inverse":
        # Read the IDs, write the int64 inverse (unique values and counts are smaller).
        return inputs.ids.numel() * (inputs.ids.element_size() + 8)
    if op == "segment_sum":
        rows = inputs.segment_rows
        segments = inputs.segment_offsets.numel() - 1
        return rows.numel() * rows.element_size() + segments * rows[0].numel() * 4
    return 2 * inputs.values.numel() * inputs.values.element_size()


def _same(got: Any, want: Any, op: str) -> str | None:
    """None when ``got`` equals ``want`` (close, for float sums), else what differs."""
    if op == "segment_sum":
        return None if torch.allclose(got, want, rtol=1e-4, atol=1e-3) else "sums differ"
    names = ("values", "lengths") if isinstance(want, JaggedTensor) else type(want)._fields
    for name, a, b in zip(names, got, want, strict=True):
        if a.shape != b.shape or not torch.equal(a, b):
            return f"{name} differs"
    return None


def _time_ms(fn: Callable[[], Any], device: torch.device, config: BenchConfig) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=config.warmup_ms, rep=config.rep_ms, return_mode="median"))
    fn()
    times: list[float] = []
    deadline = time.perf_counter() + config.rep_ms / 1000
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 1000):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def copy_bandwidth_gbps(config: BenchConfig) -> float:
    """Device-to-device ``copy_`` bandwidth (read + write) on a buffer much larger than caches."""
    device = torch.device(config.device)
    size = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), device, config)
    return 2 * size / (ms * 1e-3) / 1e9


def _triton_skip_reason(device: torch.device) -> str | None:
    if not triton_available():
        return "triton is not installed"
    if device.type != "cuda" and not interpreting():
        return "needs CUDA (or TRITON_INTERPRET=1)"
    return None


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def run(config: BenchConfig, progress: bool = False) -> dict[str, Any]:
    """Measures everything ``config`` asks for; never raises for a failing provider.

    Args:
        config: what to measure.
        progress: show a progress bar on stderr, one tick per (case, world size).
    """
    device = torch.device(config.device)
    points = sum(len(world_sizes_of(config, case)) for case in cases_of(config))
    bar = tqdm(total=points, desc="kernels bench", unit="point", disable=not progress, leave=False)
    triton_skip = _triton_skip_reason(device)
    report: dict[str, Any] = {"meta": _meta(config), "results": []}
    try:
        report["meta"]["copy_gbps"] = copy_bandwidth_gbps(config)
    except Exception as exc:  # a failed probe must not lose the kernel timings
        report["meta"]["copy_gbps"] = None
        report["meta"]["copy_error"] = _error(exc)
    for case in cases_of(config):
        try:
            values, lengths = make_case(config, case)
        except Exception as exc:
            report["results"].append({"case": case, "error": _error(exc)})
            continue
        for world_size in world_sizes_of(config, case):
            bar.set_postfix_str(f"{case} W={world_size}")
            bar.update()
            try:
                inputs = make_inputs(config, values, lengths, world_size)
            except Exception as exc:
                row = {"case": case, "world_size": world_size, "error": _error(exc)}
                report["results"].append(row)
                continue
            for op in config.ops:
                if ONLY_KIND.get(op, case_kind(case)) != case_kind(case):
                    continue
                report["results"].extend(
                    _measure(op, case, world_size, inputs, config, triton_skip)
                )
            if config.profile and device.type == "cuda" and not triton_skip:
                largest = is_large(case) or not config.large_batch
                if largest and world_size == world_sizes_of(config, case)[-1]:
                    profiles = report.setdefault("profile", [])
                    profiles.append(_profile(inputs, config, case, world_size))
            del inputs
            if device.type == "cuda":
                torch.cuda.empty_cache()
    bar.close()
    return report


def _profile(
    inputs: Inputs, config: BenchConfig, case: str, world_size: int, calls: int = 5
) -> dict[str, Any]:
    """Per Triton operation: its GPU kernels (count and time per call) and the launch gaps."""
    from torch.profiler import ProfilerActivity, profile

    out: dict[str, Any] = {"case": case, "world_size": world_size, "ops": {}}
    for op in config.ops:
        if ONLY_KIND.get(op, case_kind(case)) != case_kind(case):
            continue
        try:
            fn = _call(op, inputs, "triton", config.tiles)
            fn()
            torch.cuda.synchronize()
            spans = []
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    torch.cuda.synchronize()
                    fn()
                    torch.cuda.synchronize()
            kernels: dict[str, list[float]] = {}
            device_events = [
                e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            ]
            for event in device_events:
                name = event.name[:80]
                entry = kernels.setdefault(name, [0, 0.0])
                entry[0] += 1
                entry[1] += event.time_range.elapsed_us()
            busy = sum(total for _, total in kernels.values())
            if device_events:
                starts = sorted(e.time_range.start for e in device_events)
                ends = sorted(e.time_range.end for e in device_events)
                spans = [ends[-1] - starts[0]]
            out["ops"][op] = {
                "kernels": [
                    {"name": name, "per_call": count / calls, "us_per_call": total / calls}
                    for name, (count, total) in sorted(kernels.items(), key=lambda kv: -kv[1][1])
                ],
                "launches_per_call": sum(count for count, _ in kernels.values()) / calls,
                "kernel_us_per_call": busy / calls,
                "first_to_last_us_total": spans[0] if spans else None,
            }
        except Exception as exc:
            out["ops"][op] = {"error": _error(exc)}
    return out


def _measure(
    op: str,
    case: str,
    world_size: int,
    inputs: Inputs,
    config: BenchConfig,
    triton_skip: str | None,
) -> list[dict[str, Any]]:
    device = torch.device(config.device)
    moved = _bytes_moved(op, inputs)
    check: str | None = None
    if config.check:
        check = "skipped" if triton_skip else None  # the row's note gives the reason
        if check is None:
            try:
                triton_out = _call(op, inputs, "triton", config.tiles)()
                diff = _same(triton_out, _call(op, inputs, "reference")(), op)
                check = "pass" if diff is None else f"FAIL: {diff}"
            except Exception as exc:
                check = f"error: {_error(exc)}"
    rows = []
    for provider in config.providers:
        if provider == "naive" and (op not in NAIVE_OPS or is_large(case)):
            continue
        row: dict[str, Any] = {
            "op": op,
            "case": case,
            "world_size": world_size,
            "provider": provider,
            "bytes": moved,
            "ms": None,
            "gbps": None,
        }
        if provider == "triton" and triton_skip:
            row["skipped"] = triton_skip
            rows.append(row)
            continue
        try:
            fn = _call(op, inputs, provider, config.tiles)
            ms = _time_ms(fn, device, config)
            row["ms"] = ms
            row["gbps"] = moved / (ms * 1e-3) / 1e9
            graphs = config.graphs and provider != "naive" and op not in HOST_SYNC_OPS
            if device.type == "cuda" and graphs:
                row.update(_gpu_times(op, inputs, provider, fn, moved, config))
        except Exception as exc:
            row["error"] = _error(exc)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
    if check is not None and rows:
        rows[0]["check"] = check
    return rows


def _gpu_times(
    op: str,
    inputs: Inputs,
    provider: str,
    fn: Callable[[], Any],
    moved: int,
    config: BenchConfig,
) -> dict[str, Any]:
    """gpu_ms (graph replay), host_ms and, for split Triton operations, plan / copy GPU times."""
    times: dict[str, Any] = {"host_ms": _host_ms(fn)}
    try:
        gpu = _graph_ms(fn, config)
        times["gpu_ms"] = gpu
        times["gpu_gbps"] = moved / (gpu * 1e-3) / 1e9
    except Exception as exc:  # host syncs cannot be captured
        times["gpu_error"] = _error(exc)
    if provider == "triton" and op in SPLIT_OPS:
        try:
            plan, copy = _split_calls(op, inputs, config.tiles)
            times["plan_gpu_ms"] = _graph_ms(plan, config)
            times["copy_gpu_ms"] = _graph_ms(copy, config)
        except Exception as exc:
            times["split_error"] = _error(exc)
    return times


def _meta(config: BenchConfig) -> dict[str, Any]:
    device = torch.device(config.device)
    meta: dict[str, Any] = {
        "config": asdict(config),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "interpreter": interpreting(),
        "timer": "triton.testing.do_bench median" if device.type == "cuda" else "wall-clock median",
    }
    if triton_available():
        import triton

        meta["triton"] = triton.__version__
    return meta


def _fmt(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def format_table(report: dict[str, Any]) -> str:
    """The results as a fixed-width table, with speedups of Triton over the others.

    ``ms`` is an eager call, ``gpu`` its CUDA-graph replay (GPU time alone), ``plan+copy`` the
    split of Triton's GPU time, ``host`` the wall time to enqueue one call; ``%copy`` compares
    GB/s with the device ``copy_`` (eager / GPU time); ``x`` is the speedup of Triton (eager /
    GPU time).
    """
    copy_gbps = report["meta"].get("copy_gbps")
    head = (
        f"{'op':<19} {'case':<10} {'W':>4} {'provider':<10} {'ms':>8} {'gpu':>8} "
        f"{'plan+copy':>15} {'host':>7} {'%copy':>11} {'x':>13}  note"
    )
    lines = [head, "-" * len(head)]
    best = {
        (r["op"], r["case"], r["world_size"]): r
        for r in report["results"]
        if r.get("provider") == "triton" and r.get("ms")
    }
    for r in report["results"]:
        if "provider" not in r:
            lines.append(f"{r.get('case', '?'):<30} W={r.get('world_size', '-')}: {r['error']}")
            continue
        ms, gpu = r["ms"], r.get("gpu_ms")
        base = best.get((r["op"], r["case"], r["world_size"]))
        speed = ""
        if ms and base and r["provider"] != "triton":
            speed = f"{ms / base['ms']:.1f}x"
            if gpu and base.get("gpu_ms"):
                speed += f"/{gpu / base['gpu_ms']:.1f}x"
        share = ""
        if copy_gbps and r.get("gbps"):
            share = f"{100 * r['gbps'] / copy_gbps:.0f}%"
            if r.get("gpu_gbps"):
                share += f"/{100 * r['gpu_gbps'] / copy_gbps:.0f}%"
        split = ""
        if r.get("plan_gpu_ms") is not None and r.get("copy_gpu_ms") is not None:
            split = f"{r['plan_gpu_ms']:.3f}+{r['copy_gpu_ms']:.3f}"
        note = r.get("error") or r.get("skipped") or ""
        if r.get("gpu_error"):
            note = "no graph: " + r["gpu_error"].split(":")[0]
        if "check" in r:
            note = f"check {r['check']}: {note}" if note else f"check {r['check']}"
        label = "naive-loop" if r["provider"] == "naive" else r["provider"]
        lines.append(
            f"{r['op']:<19} {r['case']:<10} {r['world_size']:>4} {label:<10} "
            f"{_fmt(ms, '.4f'):>8} {_fmt(gpu, '.4f'):>8} {split:>15} "
            f"{_fmt(r.get('host_ms'), '.3f'):>7} {share:>11} {speed:>13}  {note}"
        )
    if copy_gbps:
        lines.append(f"device copy_ bandwidth (read + write): {copy_gbps:.1f} GB/s")
    for profile in report.get("profile", []):
        lines.append(
            f"profile ({profile['case']}, W={profile['world_size']}), per call: "
            "launches, kernel time, kernels"
        )
        for op, p in profile["ops"].items():
            if "error" in p:
                lines.append(f"  {op}: {p['error']}")
                continue
            top = ", ".join(f"{k['name'][:32]} {k['us_per_call']:.1f}us" for k in p["kernels"][:4])
            lines.append(
                f"  {op}: {p['launches_per_call']:.0f} launches, "
                f"{p['kernel_us_per_call']:.1f} us in kernels: {top}"
            )
    return "\n".join(lines)


def headline(report: dict[str, Any]) -> list[str]:
    """One line per (op, case) at the largest world size: Triton's latency and its speedups."""
    rows = [r for r in report["results"] if r.get("ms")]
    copy_gbps = report["meta"].get("copy_gbps")
    lines = []
    for op, case in dict.fromkeys((r["op"], r["case"]) for r in rows):
        mine = [r for r in rows if r["op"] == op and r["case"] == case]
        world = max(r["world_size"] for r in mine)
        at = {r["provider"]: r for r in mine if r["world_size"] == world}
        if "triton" not in at:
            continue
        fast = at["triton"]
        parts = [f"{op} {case} W={world}: triton {fast['ms']:.4f} ms"]
        if fast.get("gpu_ms"):
            parts[0] += f" ({fast['gpu_ms']:.4f} ms GPU)"
        for provider, label in (("reference", "vectorized eager"), ("naive", "naive loop")):
            if provider in at:
                text = f"{at[provider]['ms'] / fast['ms']:.1f}x over {label}"
                if at[provider].get("gpu_ms") and fast.get("gpu_ms"):
                    text += f" ({at[provider]['gpu_ms'] / fast['gpu_ms']:.1f}x GPU)"
                parts.append(text)
        if copy_gbps:
            text = f"{100 * fast['gbps'] / copy_gbps:.0f}% of copy bandwidth"
            if fast.get("gpu_gbps"):
                text += f" ({100 * fast['gpu_gbps'] / copy_gbps:.0f}% GPU)"
            parts.append(text)
        lines.append(", ".join(parts))
    return lines


def write_report(report: dict[str, Any], out: Path) -> list[Path]:
    """Writes ``kernels_bench.json`` and, with matplotlib, one ``<op>.png`` per operation."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "kernels_bench.json"
    path.write_text(json.dumps(report, indent=2))
    written = [path]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    rows = [r for r in report["results"] if "op" in r]
    for op in dict.fromkeys(r["op"] for r in rows):
        cases = list(dict.fromkeys(r["case"] for r in rows if r["op"] == op))
        fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4.5), squeeze=False)
        for ax, case in zip(axes[0], cases, strict=True):
            for provider in dict.fromkeys(r["provider"] for r in rows):
                label = "naive per-rank loop" if provider == "naive" else provider
                mine = [
                    r
                    for r in rows
                    if r["op"] == op and r["case"] == case and r["provider"] == provider
                ]
                for key, style, suffix in (("ms", "-", ""), ("gpu_ms", "--", " (GPU, graph)")):
                    points = [(r["world_size"], r[key]) for r in mine if r.get(key)]
                    if points:
                        ax.plot(*zip(*points, strict=True), style, marker="o", label=label + suffix)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("world size")
            ax.set_ylabel("latency (ms, median)")
            ax.set_title(f"{op} — {case}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"{report['meta']['device']} · torch {report['meta']['torch']}")
        # Fixed margins: tight_layout measures every tick label and costs seconds per figure.
        fig.subplots_adjust(left=0.08, right=0.98, bottom=0.12, top=0.84, wspace=0.25)
        png = out / f"{op}.png"
        fig.savefig(png, dpi=120)
        plt.close(fig)
        written.append(png)
    return written
