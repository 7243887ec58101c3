"""Where the CPU of a large freescale AllToAll between ranks of one host goes: the copy, or the
kernel pinning the sender's pages for it.

Local ranks (torch's default thread count, as ``freescale comm bench``) run back-to-back
``all_to_all_single`` calls of ``--size`` bytes on CPU tensors (freescale only, with
``shm_max_bytes`` 512 KiB whatever the pages: every rank reads its peers' pieces above that
from their memory). Each rank prints its wall time, user and system CPU per
call. With ``--perf`` rank 0 samples every CPU with ``perf record -a`` over the middle half of
its timed loop, and the samples are split into the kernel's copy of the bytes, its pinning of
the sender's pages (page-table walks, reference counts), libc's copies (the rank's own piece)
and the Python interpreter. Run it with and without ``THP_MEM_ALLOC_ENABLE=1`` (torch asks for
huge pages for its tensors of 2 MiB and more) to see what huge pages change.

``--backend gloo`` runs the same loop over Gloo instead, as the baseline.

    [THP_MEM_ALLOC_ENABLE=1] python benchmarks/host_reads_profile.py [--ranks 4] [--size 16M]
        [--calls 4000] [--backend freescale|gloo] [--perf]
        (perf needs root or perf_event_paranoid <= -1)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
import time
from typing import Any

from freescale_comm._freescale_args import byte_size, int_at_least
from freescale_comm._local_ranks import GroupSpec, run_ranks_or_exit
from freescale_comm.info import transparent_huge_pages
from freescale_comm.options import READ_ABOVE_BYTES

# Kernel functions of pinning a process's pages for process_vm_readv (get_user_pages, Linux 6.x).
PINNING = {
    "__get_user_pages",
    "follow_page_pte",
    "follow_page_mask",
    "follow_pmd_mask",
    "follow_trans_huge_pmd",
    "vm_normal_page",
    "__pte_offset_map_lock",
    "___pte_offset_map",
    "vma_pgtable_walk_end",
    "try_grab_folio",
    "gup_put_folio",
    "unpin_user_pages",
}
SHARES = {
    "kernel copy": lambda sym, dso: sym in ("_copy_to_iter", "copy_page_to_iter"),
    "page pinning": lambda sym, dso: sym in PINNING,
    "libc copy": lambda sym, dso: dso.startswith("libc") and "mem" in sym,
    "python": lambda sym, dso: dso.startswith("libpython"),
    "idle": lambda sym, dso: "halt" in sym or "idle" in sym,
}
WARMUP_CALLS = 20
MIN_PERF_S = 2.0  # perf takes a good part of a second to start sampling


def _rank(args: argparse.Namespace) -> dict[str, Any]:
    """Back-to-back AllToAlls: wall time, user and system CPU per call (seconds); rank 0 with
    ``--perf`` also returns perf's report of the middle half of the loop."""
    import torch
    import torch.distributed as dist

    inp = torch.rand(args.size // 4)
    out = torch.empty_like(inp)
    for _ in range(2):  # the first pass pays for connections and pages; the second is timed
        start = time.perf_counter()
        for _ in range(WARMUP_CALLS):
            dist.all_to_all_single(out, inp)
    # Rank 0's estimate on every rank, so that all decide alike whether the loop runs.
    span_of_rank0 = torch.tensor([(time.perf_counter() - start) / WARMUP_CALLS * args.calls])
    dist.broadcast(span_of_rank0, src=0)
    span = float(span_of_rank0)
    if args.perf and span / 2 < MIN_PERF_S:
        raise SystemExit(
            f"--perf: the loop would last about {span:.1f} s, and perf needs at least "
            f"{2 * MIN_PERF_S:.0f} s of it; give more --calls"
        )
    folder = tempfile.mkdtemp() if args.perf and dist.get_rank() == 0 else None
    perf = None
    try:
        dist.barrier()
        if folder is not None:
            # sh waits a quarter of the loop, then becomes perf (the values as its arguments).
            perf = subprocess.Popen(
                [
                    "sh",
                    "-c",
                    'sleep "$1" && exec perf record -a -o "$2" -- sleep "$3"',
                    "sh",
                    f"{span / 4:.3f}",
                    os.path.join(folder, "perf.data"),
                    f"{span / 2:.3f}",
                ],
                stderr=subprocess.PIPE,
                text=True,
            )
        start, cpu = time.perf_counter(), os.times()
        for _ in range(args.calls):
            dist.all_to_all_single(out, inp)
        wall, end = time.perf_counter() - start, os.times()
        result: dict[str, Any] = {
            "wall": wall / args.calls,
            "user": (end.user - cpu.user) / args.calls,
            "system": (end.system - cpu.system) / args.calls,
        }
        if perf is not None:
            _, errors = perf.communicate(timeout=span + 60)
            if perf.returncode != 0:
                raise RuntimeError(f"perf record failed ({perf.returncode}): {errors.strip()}")
            if wall < 3 * span / 4:
                print(f"warning: the loop ended ({wall:.1f} s) before perf's window did")
            data = os.path.join(folder, "perf.data")
            result["perf_report"] = subprocess.run(
                ["perf", "report", "-i", data, "--no-children", "--sort", "dso,sym", "--stdio"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        return result
    finally:
        if perf is not None and perf.poll() is None:
            perf.kill()
            perf.wait()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def shares(report: str) -> dict[str, float]:
    """The percentage of perf's samples in each of ``SHARES``."""
    found = dict.fromkeys(SHARES, 0.0)
    for line in report.splitlines():
        match = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[.\]\s+(\S+)", line)
        if not match:
            continue
        percent, dso, sym = float(match[1]), match[2], match[3]
        for name, belongs in SHARES.items():
            if belongs(sym, dso):
                found[name] += percent
                break
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int_at_least(2), default=4)
    parser.add_argument("--size", type=byte_size, default="16M", help="bytes per rank")
    parser.add_argument("--calls", type=int_at_least(1), default=4000)
    parser.add_argument("--backend", choices=("freescale", "gloo"), default="freescale")
    parser.add_argument("--perf", action="store_true", help="sample the run with perf")
    args = parser.parse_args()
    ours = args.backend == "freescale"
    spec = GroupSpec(
        args.ranks,
        args.backend,
        init_timeout_s=120,
        setup="freescale_comm:register" if ours else None,
        threads=None,
        # Reads above 512 KiB whatever the pages (by default 4 KiB pages take the rings).
        env={"FREESCALE_SHM_MAX_BYTES": str(READ_ABOVE_BYTES)} if ours else {},
    )
    rows = run_ranks_or_exit(spec, _rank, args, timeout_s=1800)
    asks = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")
    print(
        f"{args.backend} AllToAll of {args.size} B, {args.ranks} ranks; "
        f"THP_MEM_ALLOC_ENABLE={asks}, kernel "
        f"huge pages: {transparent_huge_pages()}"
    )
    for rank, row in enumerate(rows):
        print(
            f"  rank {rank}: {row['wall'] * 1e3:.2f} ms per call, CPU user "
            f"{row['user'] * 1e3:.2f} system {row['system'] * 1e3:.2f} ms"
        )
    if args.perf:
        found = shares(rows[0]["perf_report"])
        print("  perf samples: " + ", ".join(f"{k} {v:.1f}%" for k, v in found.items()))
        if found["idle"] > 5:
            print("  warning: the cores idled in perf's window; the shares are not the loop's")


if __name__ == "__main__":
    main()
