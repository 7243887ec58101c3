"""The report: the JSON file, its summary, and the text table printed last."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from .settings import GIB, JSON_NAME, KIB, MIB, OPS, TARGET_GAP, TARGET_PCT
from .sizes import fmt_size


def write_json(out: Path, report: dict[str, Any]) -> None:
    """Rewrites the report under ``out`` (whole or not at all: a temporary file, then a rename)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (JSON_NAME + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(out / JSON_NAME)


def section_result(report: dict[str, Any], phase: str, name: str) -> Any:
    """The result of part ``name`` of ``phase``, or ``None``."""
    return report["phases"].get(phase, {}).get("sections", {}).get(name, {}).get("result")


def main_section(report: dict[str, Any], name: str) -> Any:
    """A part of the main phase: its own result, or its retry's where it has none."""
    first = section_result(report, "main", name)
    if isinstance(first, dict) and not ("error" in first or "skipped" in first):
        return first
    retry = section_result(report, "main_retry", name)
    return retry if retry is not None else first


def sweep_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The sweep rows of every phase."""
    rows = []
    for phase in report["phases"]:
        result = section_result(report, phase, "sweep")
        if isinstance(result, dict):
            rows.extend(result.get("rows", []))
    return rows


def overlap_combos(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(phase, combo) of every phase's overlap part."""
    combos = []
    for phase in report["phases"]:
        result = section_result(report, phase, "overlap")
        if isinstance(result, dict):
            combos.extend((phase, c) for c in result.get("combos", []))
    return combos


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The verdicts: correctness, sweep errors, peak busbw, kernels, overlap targets."""
    summary: dict[str, Any] = {}
    corr = main_section(report, "correctness")
    if isinstance(corr, dict) and "rows" in corr:
        summary["correctness_all_ok"] = corr["all_ok"]
        summary["correctness_failures"] = [
            f"{r['path']} {r['dtype']} {k}"
            for r in corr["rows"]
            if "checks" in r
            for k, c in r["checks"].items()
            if not c["ok"]
        ]
    rows = sweep_rows(report)
    summary["sweep_incorrect"] = [
        f"{r['backend']} {r['op']} {fmt_size(r['bytes'])}"
        for r in rows
        if r.get("correct") is False
    ]
    summary["sweep_errors"] = len([r for r in rows if "error" in r])
    peak: dict[str, dict[str, float]] = {}
    for r in rows:
        if "busbw_gbps" in r:
            best = peak.setdefault(r["op"], {})
            best[r["backend"]] = max(best.get(r["backend"], 0.0), r["busbw_gbps"])
    summary["peak_busbw_gbps"] = peak
    targets = {}
    for phase, c in overlap_combos(report):
        for backend, t in c.get("target", {}).items():
            targets[f"{phase}:{c['compute']}:{c['op']}:{fmt_size(c['bytes'])}:{backend}"] = t["met"]
    kern = main_section(report, "kernels")
    if isinstance(kern, dict):
        summary["kernels_per_collective_rank0"] = {
            backend: {
                op: v.get("kernels_per_op") for op, v in per_rank[0].items() if isinstance(v, dict)
            }
            for backend, per_rank in kern.items()
            if isinstance(per_rank, list) and isinstance(per_rank[0], dict)
        }
        ce = summary["kernels_per_collective_rank0"].get("nccl_ce")
        if ce:
            summary["nccl_ce_copy_engine_engaged"] = {op: k == 0 for op, k in ce.items()}
    summary["overlap_target_met"] = targets
    summary["overlap_target_met_all"] = bool(targets) and all(targets.values())
    return summary


def format_table(report: dict[str, Any]) -> str:
    """The short text table printed last."""
    lines = [
        f"== freescale vs NCCL, {report['nprocs']} ranks"
        f"{' (DRY RUN: CPU, Gloo for NCCL)' if report['dry_run'] else ''} =="
    ]
    info = report.get("info", {})
    if isinstance(info, dict):
        lines.append(
            f"torch {info.get('torch')}  NCCL {info.get('nccl')}  UCX {info.get('ucx')}"
            f"  cuda_ipc {info.get('cuda_ipc')}  transports "
            f"{','.join(info.get('ucx_transports', []) or [])[:120]}"
        )
    setup = main_section(report, "setup")
    if isinstance(setup, dict) and "ranks" in setup:
        r0 = setup["ranks"][0]
        lines.append(
            f"groups in one process ok: {setup['all_groups_ok']}  nccl_ce: "
            f"{str(r0.get('nccl_ce', '-'))[:100]}"
        )
    elif setup is not None:
        lines.append(f"setup: {str(setup)[:300]}")
    corr = main_section(report, "correctness")
    if isinstance(corr, dict) and "rows" in corr:
        for row in corr["rows"]:
            if "checks" not in row:
                lines.append(f"correct: {row}")
                continue
            bad = [k for k, c in row["checks"].items() if not c["ok"]]
            no_ref = [k for k, c in row["checks"].items() if not c.get("nccl_reference", True)]
            if report.get("share_gpu"):
                no_nccl = " (vs expected only: no NCCL with --share-gpu)"
            elif no_ref:
                no_nccl = f" (vs expected only, NCCL failed: {','.join(no_ref)})"
            else:
                no_nccl = ""
            lines.append(
                f"correct {row['path']:<9} {row['dtype']:<9} vs NCCL: "
                f"{'OK' if row['all_ok'] else 'FAIL ' + ','.join(bad)}{no_nccl}"
            )
    elif corr is not None:
        lines.append(f"correctness: {str(corr)[:300]}")
    for phase in report["phases"]:
        kern = section_result(report, phase, "kernels")
        if isinstance(kern, dict) and "skipped" not in kern and "error" not in kern:
            parts = []
            for backend, per_rank in kern.items():
                first = per_rank[0] if isinstance(per_rank, list) else per_rank
                if not isinstance(first, dict):
                    continue
                counts = [
                    f"{'a2a' if op.startswith('all_to') else 'ag'} {v.get('kernels_per_op')}"
                    for op, v in first.items()
                    if isinstance(v, dict)
                ]
                parts.append(
                    f"{backend}: {first['error'][:60]}"
                    if "error" in first
                    else f"{backend}: {', '.join(counts)}"
                )
            lines.append(f"[{phase}] CUDA kernels per collective (rank 0): " + "; ".join(parts))
    rows = sweep_rows(report)
    if rows:
        sizes = sorted({r["bytes"] for r in rows})
        show = [s for s in sizes if s in (8, 64 * KIB, MIB, 16 * MIB, 256 * MIB, GIB)]
        if sizes and sizes[-1] not in show:
            show.append(sizes[-1])
        for op in OPS:
            lines.append(
                f"sweep {op}: time us (< 1 MiB) / busbw GB/s (>= 1 MiB); '!' = wrong result"
            )
            lines.append(f"  {'backend':<16}" + "".join(f"{fmt_size(s):>11}" for s in show))
            backends = list(dict.fromkeys(r["backend"] for r in rows if r["op"] == op))
            for backend in backends:
                cells = []
                for s in show:
                    hit = [
                        r
                        for r in rows
                        if r["op"] == op and r["backend"] == backend and r["bytes"] == s
                    ]
                    if not hit:
                        cells.append("-")
                    elif "error" in hit[0]:
                        cells.append("err")
                    else:
                        r = hit[0]
                        value = f"{r['time_us']:.1f}" if s < MIB else f"{r['busbw_gbps']:.1f}"
                        cells.append(value + ("" if r["correct"] else "!"))
                lines.append(f"  {backend:<16}" + "".join(f"{c:>11}" for c in cells))
    combos = overlap_combos(report)
    if combos:
        lines.append(
            f"overlap: compute slowdown % (mean of ranks) while each backend moves "
            f"data; target freescale < {TARGET_PCT}% and >= {TARGET_GAP} points "
            f"below NCCL"
        )
        for phase, c in combos:
            head = f"  [{phase}] {c['compute']:<18} {c['op']:<23} {fmt_size(c['bytes']):>8}"
            if "slowdown_pct_mean" not in c:
                lines.append(head + f" {c.get('skipped') or str(c.get('error'))[:80]}")
                continue
            cells = ", ".join(f"{b} {v:+.2f}" for b, v in c["slowdown_pct_mean"].items())
            met = [b for b, t in c.get("target", {}).items() if t["met"]]
            lines.append(
                head
                + f" alone {statistics.fmean(c['alone_ms']):.2f} ms: {cells}"
                + (f"  target met: {','.join(met)}" if c.get("target") else "")
            )
    embed = report.get("embed")
    if embed is not None:
        status = embed.get("status") if isinstance(embed, dict) else embed
        lines.append(
            f"embed: {status} (exposed ms per step, mean of ranks: sync / prioritized;"
            " '=' prioritized bitwise equal to sync)"
        )
        for backend in ("freescale", "nccl"):
            result = embed.get(backend) if isinstance(embed, dict) else None
            if not isinstance(result, dict):
                continue
            points = (result.get("report") or {}).get("points") or []
            cells = [
                f"{p['collision_rate']:.0%} {p['sync']['exposed_ms']:.1f}/"
                f"{p['prioritized']['exposed_ms']:.1f}{'=' if p.get('exact') else '!'}"
                for p in points
            ]
            problem = result.get("error") or result.get("skipped")
            lines.append(f"  {backend:<10} " + (", ".join(cells) or str(problem)[:150]))
    problems = [f"error: {report['error']}"] if report.get("error") else []
    for phase, record in report["phases"].items():
        for name, sec in record.get("sections", {}).items():
            res = sec.get("result")
            if isinstance(res, dict) and (res.get("error") or res.get("skipped")):
                why = res.get("error") or res.get("skipped")
                problems.append(f"{phase}/{name}: {why}"[:160])
        for err in record.get("rank_errors", []):
            problems.append(f"{phase}: {str(err)[:160]}")
        if record.get("skipped"):
            problems.append(f"{phase}: skipped ({record['skipped']})")
    lines.extend(f"! {p}" for p in problems)
    lines.append(f"elapsed {report.get('elapsed_s')} s; JSON {report['json']}")
    return "\n".join(lines)
