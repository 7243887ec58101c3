"""The parent's side of a phase: its ranks on the one launcher, its parts, a retry."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from .report import write_json
from .settings import SAFE_ENV, SECTION_MIN


def run_phase(
    args: argparse.Namespace,
    phase: dict[str, Any],
    deadline: float,
    hard_deadline: float,
    report: dict[str, Any],
) -> None:
    """Runs one phase on ``args.nprocs`` ranks of the one launcher (``_local_ranks``): the ranks
    join their groups, then one launcher run per part, the JSON rewritten after each.
    A rank that dies or is still running at ``hard_deadline`` ends the phase (the launcher
    stops every rank); what was running then is kept for ``retry_phase``."""
    from freescale_comm._local_ranks import GroupSpec, LocalGroup, RankFailure

    from .rank import finish_rank, init_rank, run_section

    record: dict[str, Any] = {
        "env": phase["env"],
        "backends": phase["backends"],
        "sections": {},
        "rank_errors": [],
    }
    report["phases"][phase["name"]] = record
    # The ranks set the phase's environment first thing; NCCL reads it once per process.
    spec = GroupSpec(args.nprocs, backend=None, env={**SAFE_ENV, **phase["env"]}, threads=None)
    group = LocalGroup.of(spec)
    scratch = Path(tempfile.mkdtemp(prefix="multi_gpu_"))
    progress = scratch / "progress.json"

    def left() -> float:
        return max(1.0, hard_deadline - time.time())

    t0 = time.time()
    step = "init"
    completed = False
    try:
        saved = {k: os.environ.get(k) for k in phase["env"]}
        os.environ.update(phase["env"])  # the children also set it first thing
        try:
            group.start(left())
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        init = (args, phase, deadline, str(progress))
        group.run(init_rank, *init, timeout_s=left(), stop_on_error=True)
        sections = [s for s in phase["sections"] if s in args.sections]
        for index, name in enumerate(sections):
            step = name
            reserve = sum(SECTION_MIN[s] for s in sections[index + 1 :])
            replies = group.run(run_section, name, reserve, timeout_s=left(), stop_on_error=True)
            for rank, reply in enumerate(replies):
                if reply is None:
                    continue
                payload, seconds = reply
                if rank == 0:
                    record["sections"][name] = {"result": payload, "seconds": seconds}
                else:
                    record["rank_errors"].append({"rank": rank, "section": name, "result": payload})
            _note_progress(record, progress)
            write_json(args.out, report)
        step = "finish"
        group.run(finish_rank, timeout_s=min(20.0, left()), stop_on_error=True)
        completed = True
    except RankFailure as failure:
        _record_failure(record, step, failure)
    finally:
        group.close()
        _note_progress(record, progress)
        shutil.rmtree(scratch, ignore_errors=True)
    record["completed"] = completed
    record["seconds"] = round(time.time() - t0, 1)
    write_json(args.out, report)


def _note_progress(record: dict[str, Any], progress: Path) -> None:
    """The (part, backend) rank 0 last said it was running."""
    with contextlib.suppress(OSError, ValueError):  # not written yet
        record["last_progress"] = json.loads(progress.read_text())


def _record_failure(record: dict[str, Any], step: str, failure: Any) -> None:
    """What each failed rank's launcher report says, where the report keeps it."""
    for rank, (kind, detail) in failure.failures.items():
        if kind == "stopped":  # not waited for once another rank had failed
            continue
        if kind == "timeout":
            record["rank_errors"].append(f"rank {rank}: phase stopped at its deadline ({step})")
        elif kind == "died":
            record["rank_errors"].append(f"rank {rank} exited early in {step}: {detail}")
        elif step == "init" and rank == 0:
            record["sections"]["init"] = {"result": {"error": detail[-2300:]}, "seconds": 0.0}
        else:
            error = {"error": detail[-2300:]}
            record["rank_errors"].append({"rank": rank, "section": step, "result": error})


def retry_phase(phase: dict[str, Any], record: dict[str, Any]) -> dict[str, Any] | None:
    """After a phase whose processes died or hung: the parts it did not finish, once more,
    without the backend that was running when it stopped."""
    if record.get("completed", True) or phase.get("retry"):
        return None
    section, suspect = (record.get("last_progress") or [None, None])[:2]
    finished = [
        s
        for s, v in record["sections"].items()
        if s != "setup"
        and isinstance(v.get("result"), dict)
        and "error" not in v["result"]
        and "skipped" not in v["result"]
    ]
    sections = [s for s in phase["sections"] if s == "setup" or s not in finished]
    backends = [b for b in phase["backends"] if b != suspect]
    if not backends or sections == ["setup"]:
        return None
    record["retried_without"] = {"backend": suspect, "stopped_in": section}
    return {
        **phase,
        "name": f"{phase['name']}_retry",
        "backends": backends,
        "sections": sections,
        "retry": True,
        "dropped": suspect,
    }
