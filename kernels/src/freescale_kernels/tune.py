"""``python -m freescale_kernels.tune``: sweep the tile shapes of the copy and segment-sum kernels.

Times the copy kernel alone (``ranged.move`` of a dispatch plan, one launch) and ``segment_sum``
on the benchmark's inputs for each candidate tile, checks every candidate's output against the
first one bit for bit, and writes ``tune.json`` with the GB/s of each and the best candidate
(highest geometric mean of GB/s over the cases). Candidates are passed to the kernels as
``freescale_kernels.tiles`` settings; the chosen one becomes ``tiles.TUNED`` by hand, with the
results file cited, so that the defaults do not depend on a tuning run at import.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import astuple
from pathlib import Path
from typing import Any

import torch

from freescale_kernels import api, bench
from freescale_kernels.tiles import CopyTile, SumTile, Tiles

# Binary search first (the reference every other candidate must match bit for bit), then the
# wide search.
COPY_CANDIDATES = (
    CopyTile(16384, 2048, 4, 0),
    CopyTile(8192, 1024, 4, 0),
    CopyTile(16384, 2048, 8, 0),
    CopyTile(8192, 1024, 4, 128),
    CopyTile(16384, 2048, 4, 128),
    CopyTile(16384, 2048, 8, 128),
    CopyTile(32768, 4096, 8, 128),
    CopyTile(32768, 4096, 16, 128),
)
SUM_CANDIDATES = (SumTile(2048, 4), SumTile(4096, 4), SumTile(4096, 8), SumTile(8192, 8))


def _fields(tile: CopyTile | SumTile) -> list[int]:
    """``tile`` as the list its JSON row and ``--copy-tile`` / ``--sum-tile`` take."""
    return list(astuple(tile))


def _geomean(values: list[float]) -> float:
    if not values or min(values) <= 0:
        return 0.0
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _time(fn: Any, rep_ms: int) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, rep=rep_ms, return_mode="median"))


def _sweep_case(case: str, world_size: int, rep_ms: int) -> tuple[list[dict], list[dict]]:
    from freescale_kernels.ops import ranged

    config = bench.BenchConfig(rep_ms=rep_ms)
    values, lengths = bench.make_case(config, case)
    inputs = bench.make_inputs(config, values, lengths, world_size)
    plan = ranged.plan_dispatch(lengths, inputs.ranks, world_size, values.shape[0])[0]
    moved = 2 * values.numel() * values.element_size()
    copy_rows: list[dict[str, Any]] = []
    want = None
    # The GPU idles (and clocks down) while the inputs are built on the host: without a warm-up
    # the first candidate timed reads slow (benchmarks/results/kernels/NOTES.md, "Tile choice").
    _time(lambda: ranged.move(values, plan), rep_ms)
    for tile in COPY_CANDIDATES:
        row: dict[str, Any] = {"case": case, "tile": _fields(tile)}
        try:
            got = ranged.move(values, plan, tile)
            want = got if want is None else want
            ms = _time(lambda tile=tile: ranged.move(values, plan, tile), rep_ms)
            row.update(ms=ms, gbps=moved / ms / 1e6, same=bool(torch.equal(got, want)))
        except Exception as exc:  # a tile that does not compile or run is out of the race
            row.update(ms=None, gbps=0.0, same=True, error=f"{type(exc).__name__}: {exc}"[:300])
        copy_rows.append(row)
    sum_rows: list[dict[str, Any]] = []
    if bench.case_kind(case) == "rows":
        rows, offsets, order = inputs.segment_rows, inputs.segment_offsets, inputs.segment_order
        summed = rows.numel() * rows.element_size()
        for tile in SUM_CANDIDATES:
            tiles = Tiles(segment_sum=tile)
            ms = _time(
                lambda tiles=tiles: api.segment_sum(rows, offsets, order=order, tiles=tiles),
                rep_ms,
            )
            sum_rows.append(
                {"case": case, "tile": _fields(tile), "ms": ms, "gbps": summed / ms / 1e6}
            )
    return copy_rows, sum_rows


def sweep(world_size: int = 512, rep_ms: int = 50) -> dict[str, Any]:
    """Times every candidate tile on every benchmark case; the best by geometric mean GB/s."""
    copy_gbps = bench.copy_bandwidth_gbps(bench.BenchConfig(rep_ms=rep_ms))
    result: dict[str, Any] = {"copy_gbps": copy_gbps, "world_size": world_size}
    copy_rows: list[dict[str, Any]] = []
    sum_rows: list[dict[str, Any]] = []
    for case in bench.CASES:
        more_copy, more_sum = _sweep_case(case, world_size, rep_ms)
        copy_rows += more_copy
        sum_rows += more_sum
        torch.cuda.empty_cache()
    result["copy"] = copy_rows
    result["segment_sum"] = sum_rows

    def copy_score(candidate: CopyTile) -> float:
        mine = [r for r in copy_rows if r["tile"] == _fields(candidate)]
        if not all(r["same"] for r in mine):
            return 0.0  # a candidate that moves different bytes is out
        return _geomean([r["gbps"] for r in mine])

    result["best_copy"] = _fields(max(COPY_CANDIDATES, key=copy_score))
    best_sum = max(
        SUM_CANDIDATES,
        key=lambda c: _geomean([r["gbps"] for r in sum_rows if r["tile"] == _fields(c)]),
    )
    result["best_sum"] = _fields(best_sum)
    result["all_same"] = all(r["same"] for r in copy_rows)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m freescale_kernels.tune")
    parser.add_argument("--out", type=Path, default=Path("out/kernels_tune"))
    parser.add_argument("--world-size", type=int, default=512)
    args = parser.parse_args()
    result = sweep(args.world_size)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune.json").write_text(json.dumps(result, indent=2))
    copy_gbps = result["copy_gbps"]
    print(f"copy_ {copy_gbps:.0f} GB/s; copy kernel GB/s (% of copy_) per tile:")
    for r in result["copy"]:
        print(
            f"  {r['case']:<10} {r['tile']!s:<20} {r['ms'] or 0:.4f} ms {r['gbps']:7.0f} "
            f"{100 * r['gbps'] / copy_gbps:5.1f}% {'' if r['same'] else 'DIFFERS'}"
        )
    print("segment_sum GB/s (rows read) per tile:")
    for r in result["segment_sum"]:
        print(f"  {r['case']:<10} {r['tile']!s:<12} {r['ms']:.4f} ms {r['gbps']:7.0f}")
    best_copy = ",".join(map(str, result["best_copy"]))
    best_sum = ",".join(map(str, result["best_sum"]))
    print(f"best copy tile {best_copy}; best sum tile {best_sum}")
    print(f"BEST --copy-tile {best_copy} --sum-tile {best_sum}")
    return 0 if result["all_same"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
