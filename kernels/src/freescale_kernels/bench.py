"""``freescale kernels bench``: latency of Triton kernels vs eager references over world sizes.

For each operation, input case and world size, every provider is timed on the same inputs:
``triton`` (the kernels), ``reference`` (the best vectorized eager PyTorch) and, for the
rank-dependent operations, ``naive`` (a per-rank Python loop, labelled as such everywhere). On
CUDA, ``triton.testing.do_bench`` gives the median (L2 flushed between runs); on CPU, the median
of wall-clock repeats. Achieved GB/s counts the bytes an ideal implementation must move (values
read once and written once) and is compared with a device-to-device ``copy_`` measured in the
same run. A provider that fails is recorded with its error and the run goes on; the JSON and the
table are always written.

Inputs: ``local_batch`` samples of ``num_keys`` keys whose lengths are log-normal (median
``max_length / 8 / 4**key``, capped at ``max_length``, 5% empty), the same at every world size;
each sample gets a uniform random destination rank. Two cases: ``ids`` (1-D int64 IDs) and
``rows`` (``[N, embedding_dim]`` bf16 rows with lengths 16x shorter, like embedding AllToAlls).
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

from freescale_kernels import api
from freescale_kernels._backend import interpreting, triton_available
from freescale_kernels.layout import Dispatched
from freescale_kernels.ops import naive

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
CASES = ("ids", "rows")
# Operations measured on one case only: dedup works on IDs, gradient sums on rows.
ONLY_CASE = {"unique_with_inverse": "ids", "segment_sum": "rows"}
_ROWS_LENGTH_DIVISOR = 16


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. ``quick()`` gives sizes that run in seconds on a CPU."""

    world_sizes: tuple[int, ...] = (8, 32, 128, 512)
    local_batch: int = 1024
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

    @classmethod
    def quick(cls, **overrides: Any) -> BenchConfig:
        small = cls(
            world_sizes=(2, 8, 32),
            local_batch=64,
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


def _lengths(config: BenchConfig, divisor: int, gen: torch.Generator) -> torch.Tensor:
    rows = []
    for key in range(config.num_keys):
        median = max(config.max_length / 8 / 4**key / divisor, 1.0)
        sample = torch.empty(config.local_batch).log_normal_(math.log(median), 1.0, generator=gen)
        sample = sample.clamp(0, config.max_length // divisor).round()
        sample[torch.rand(config.local_batch, generator=gen) < 0.05] = 0
        rows.append(sample)
    return torch.stack(rows).to(torch.int64)


def make_case(config: BenchConfig, case: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, lengths ``[F, B]``) of ``case``, identical at every world size."""
    gen = torch.Generator().manual_seed(config.seed)
    device = torch.device(config.device)
    if case == "ids":
        lengths = _lengths(config, 1, gen)
        values = torch.randint(0, 2**40, (int(lengths.sum()),), generator=gen)
        return values.to(device), lengths.to(device)
    lengths = _lengths(config, _ROWS_LENGTH_DIVISOR, gen)
    rows = int(lengths.sum())
    values = torch.randn(rows, config.embedding_dim, device=device, dtype=torch.bfloat16)
    return values, lengths.to(device)


def make_inputs(
    config: BenchConfig, values: torch.Tensor, lengths: torch.Tensor, world_size: int
) -> Inputs:
    gen = torch.Generator().manual_seed(config.seed + world_size)
    device = values.device
    ranks = torch.randint(0, world_size, (config.local_batch,), generator=gen).to(device)
    sent = api.ranged_dispatch(values, lengths, ranks, world_size, backend="reference")
    # Embedding-style IDs with repeats: the first key's IDs folded onto a smaller vocabulary.
    key0 = values[: int(lengths[0].sum())] if values.dim() == 1 else values.new_zeros(0)
    ids = key0.to(torch.int64).remainder(max(key0.numel() // 4, 1))
    segment_count = config.local_batch * config.segment_rows_per_sample
    segment_ids = torch.randint(0, max(segment_count // 4, 1), (segment_count,), generator=gen)
    unique = api.unique_with_inverse(segment_ids, backend="reference")
    rows = torch.randn(segment_count, config.embedding_dim, generator=gen)
    return Inputs(
        values,
        lengths,
        ranks,
        sent,
        ids,
        rows.to(device),
        unique.offsets.to(device),
        unique.order.to(device),
    )


def _call(op: str, inputs: Inputs, provider: str) -> Callable[[], Any]:
    """A zero-argument call of ``op`` by ``provider``."""
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
    b = provider
    calls = {
        "jagged_index_select": lambda: api.jagged_index_select(
            x.values, x.lengths, sent.order, output_size=x.values.shape[0], backend=b
        ),
        "ranged_dispatch": lambda: api.ranged_dispatch(
            x.values, x.lengths, x.ranks, world, backend=b
        ),
        "ranged_combine": lambda: api.ranged_combine(
            sent.values, sent.lengths, x.ranks, keys, backend=b
        ),
        "keyed_transpose": lambda: api.keyed_transpose(
            sent.values, sent.lengths, sent.sample_counts, keys, backend=b
        ),
        "unique_with_inverse": lambda: api.unique_with_inverse(x.ids, backend=b),
        "segment_sum": lambda: api.segment_sum(
            x.segment_rows, x.segment_offsets, order=x.segment_order, backend=b
        ),
    }
    return calls[op]


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
    for name, a, b in zip(type(want)._fields, got, want, strict=True):
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


def run(config: BenchConfig) -> dict[str, Any]:
    """Measures everything ``config`` asks for; never raises for a failing provider."""
    device = torch.device(config.device)
    triton_skip = _triton_skip_reason(device)
    report: dict[str, Any] = {"meta": _meta(config), "results": []}
    try:
        report["meta"]["copy_gbps"] = copy_bandwidth_gbps(config)
    except Exception as exc:  # a failed probe must not lose the kernel timings
        report["meta"]["copy_gbps"] = None
        report["meta"]["copy_error"] = _error(exc)
    for case in CASES:
        try:
            values, lengths = make_case(config, case)
        except Exception as exc:
            report["results"].append({"case": case, "error": _error(exc)})
            continue
        for world_size in config.world_sizes:
            try:
                inputs = make_inputs(config, values, lengths, world_size)
            except Exception as exc:
                row = {"case": case, "world_size": world_size, "error": _error(exc)}
                report["results"].append(row)
                continue
            for op in config.ops:
                if ONLY_CASE.get(op, case) != case:
                    continue
                report["results"].extend(
                    _measure(op, case, world_size, inputs, config, triton_skip)
                )
            del inputs
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return report


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
        check = "skipped (no triton here)" if triton_skip else None
        if check is None:
            try:
                diff = _same(_call(op, inputs, "triton")(), _call(op, inputs, "reference")(), op)
                check = "pass" if diff is None else f"FAIL: {diff}"
            except Exception as exc:
                check = f"error: {_error(exc)}"
    rows = []
    for provider in config.providers:
        if provider == "naive" and op not in NAIVE_OPS:
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
            ms = _time_ms(_call(op, inputs, provider), device, config)
            row["ms"] = ms
            row["gbps"] = moved / (ms * 1e-3) / 1e9
        except Exception as exc:
            row["error"] = _error(exc)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
    if check is not None and rows:
        rows[0]["check"] = check
    return rows


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


def format_table(report: dict[str, Any]) -> str:
    """The results as a fixed-width table, with speedups of Triton over the others."""
    copy_gbps = report["meta"].get("copy_gbps")
    head = (
        f"{'op':<20} {'case':<5} {'W':>4} {'provider':<10} {'ms':>9} {'GB/s':>8} "
        f"{'%copy':>6} {'vs triton':>9}  note"
    )
    lines = [head, "-" * len(head)]
    triton_ms = {
        (r["op"], r["case"], r["world_size"]): r["ms"]
        for r in report["results"]
        if r.get("provider") == "triton" and r.get("ms")
    }
    for r in report["results"]:
        if "provider" not in r:
            lines.append(f"{r.get('case', '?'):<26} W={r.get('world_size', '-')}: {r['error']}")
            continue
        ms, gbps = r["ms"], r["gbps"]
        base = triton_ms.get((r["op"], r["case"], r["world_size"]))
        speed = f"{ms / base:8.1f}x" if ms and base and r["provider"] != "triton" else ""
        share = f"{100 * gbps / copy_gbps:5.1f}%" if gbps and copy_gbps else ""
        note = r.get("error") or r.get("skipped") or ""
        if "check" in r:
            note = f"check {r['check']} {note}".strip()
        label = "naive-loop" if r["provider"] == "naive" else r["provider"]
        ms_text = f"{ms:.4f}" if ms is not None else "-"
        gbps_text = f"{gbps:.1f}" if gbps is not None else "-"
        lines.append(
            f"{r['op']:<20} {r['case']:<5} {r['world_size']:>4} {label:<10} {ms_text:>9} "
            f"{gbps_text:>8} {share:>6} {speed:>9}  {note}"
        )
    if copy_gbps:
        lines.append(f"device copy_ bandwidth (read + write): {copy_gbps:.1f} GB/s")
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
        triton_ms = at["triton"]["ms"]
        parts = [f"{op} {case} W={world}: triton {triton_ms:.4f} ms"]
        for provider, label in (("reference", "vectorized eager"), ("naive", "naive loop")):
            if provider in at:
                parts.append(f"{at[provider]['ms'] / triton_ms:.1f}x over {label}")
        if copy_gbps:
            parts.append(f"{100 * at['triton']['gbps'] / copy_gbps:.0f}% of copy bandwidth")
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
        fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4.5), squeeze=False)
        for ax, case in zip(axes[0], cases, strict=True):
            for provider in dict.fromkeys(r["provider"] for r in rows):
                points = [
                    (r["world_size"], r["ms"])
                    for r in rows
                    if r["op"] == op and r["case"] == case and r["provider"] == provider and r["ms"]
                ]
                if points:
                    label = "naive per-rank loop" if provider == "naive" else provider
                    ax.plot(*zip(*points, strict=True), marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("world size")
            ax.set_ylabel("latency (ms, median)")
            ax.set_title(f"{op} — {case}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.suptitle(f"{report['meta']['device']} · torch {report['meta']['torch']}")
        # Fixed margins: tight_layout measures every tick label and costs seconds per figure.
        fig.subplots_adjust(left=0.08, right=0.98, bottom=0.12, top=0.84, wspace=0.25)
        png = out / f"{op}.png"
        fig.savefig(png, dpi=120)
        plt.close(fig)
        written.append(png)
    return written
