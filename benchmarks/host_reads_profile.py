"""Where the CPU of a large freescale AllToAll between ranks of one host goes: the copy, or the
kernel pinning the sender's pages for it.

Local ranks run back-to-back ``all_to_all_single`` calls of ``--size`` bytes on CPU tensors
(freescale only: every rank reads its peers' pieces from their memory). Each rank prints its
wall time, user and system CPU per call. With ``--perf`` a system-wide ``perf record`` samples
the middle of the run, and the samples are split into the kernel's copy of the bytes, the page
pinning (page-table walks, reference counts), libc's copies (the rank's own piece) and the
Python interpreter. Run it with and without ``THP_MEM_ALLOC_ENABLE=1`` (torch's 2 MiB pages for
tensors of 2 MiB and more) to see what huge pages change.

    [THP_MEM_ALLOC_ENABLE=1] python benchmarks/host_reads_profile.py [--ranks 4] [--size 16M]
        [--calls 5000] [--perf]   (perf needs root or perf_event_paranoid <= -1)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from freescale_comm._freescale_args import byte_size, int_at_least
from freescale_comm._local_ranks import GroupSpec, RankFailure, run_ranks

# Kernel symbols of pinning the sender's pages for process_vm_readv (Linux 6.x).
PINNING = {
    "__get_user_pages",
    "follow_page_pte",
    "follow_page_mask",
    "follow_pmd_mask",
    "follow_trans_huge_pmd",
    "vm_normal_page",
    "__pte_offset_map_lock",
    "___pte_offset_map",
    "pte_val",
    "vma_pgtable_walk_end",
    "try_grab_folio",
    "gup_put_folio",
    "unpin_user_pages",
    "mod_node_page_state",
    "__rcu_read_lock",
    "__rcu_read_unlock",
}
SHARES = {
    "kernel copy": lambda sym, dso: sym in ("_copy_to_iter", "copy_page_to_iter"),
    "page pinning": lambda sym, dso: sym in PINNING,
    "libc copy": lambda sym, dso: dso.startswith("libc") and "mem" in sym,
    "python": lambda sym, dso: dso.startswith("libpython"),
    "idle": lambda sym, dso: "halt" in sym or sym.startswith("cpuidle") or "idle" in sym,
}


def _rank(args: argparse.Namespace) -> tuple[float, float, float]:
    """Back-to-back AllToAlls; (wall, user CPU, system CPU) per call, seconds."""
    import torch
    import torch.distributed as dist

    inp = torch.rand(args.size // 4)
    out = torch.empty_like(inp)
    for _ in range(20):
        dist.all_to_all_single(out, inp)
    dist.barrier()
    start, cpu = time.perf_counter(), os.times()
    for _ in range(args.calls):
        dist.all_to_all_single(out, inp)
    wall, end = time.perf_counter() - start, os.times()
    user, system = end.user - cpu.user, end.system - cpu.system
    return wall / args.calls, user / args.calls, system / args.calls


def _perf_shares(seconds: float, delay_s: float) -> dict[str, float]:
    """Samples every CPU for ``seconds`` after ``delay_s``; the percentage of samples per share."""
    time.sleep(delay_s)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        subprocess.run(
            ["perf", "record", "-a", "-o", data, "--", "sleep", str(seconds)],
            check=True,
            capture_output=True,
        )
        report = subprocess.run(
            ["perf", "report", "-i", data, "--no-children", "--sort", "dso,sym", "--stdio"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    shares = dict.fromkeys(SHARES, 0.0)
    for line in report.splitlines():
        match = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[.\]\s+(\S+)", line)
        if not match:
            continue
        percent, dso, sym = float(match[1]), match[2], match[3]
        for name, belongs in SHARES.items():
            if belongs(sym, dso):
                shares[name] += percent
                break
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int_at_least(2), default=4)
    parser.add_argument("--size", type=byte_size, default="16M", help="bytes per rank")
    parser.add_argument("--calls", type=int_at_least(1), default=5000)
    parser.add_argument("--perf", action="store_true", help="sample the run with perf")
    args = parser.parse_args()
    spec = GroupSpec(args.ranks, "freescale", init_timeout_s=120, setup="freescale_comm:register")
    shares: dict[str, Any] = {}
    if args.perf:
        # The middle of the run: after the ranks start and warm up, before they end.
        sampler = threading.Thread(target=lambda: shares.update(_perf_shares(4.0, 8.0)))
        sampler.start()
    try:
        rows = run_ranks(spec, _rank, args, timeout_s=1800)
    except RankFailure as failure:
        raise SystemExit(f"a rank failed: {failure}") from None
    if args.perf:
        sampler.join()
    pages = os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"
    print(f"AllToAll of {args.size} B, {args.ranks} ranks, torch huge pages: {pages}")
    for rank, (wall, user, system) in enumerate(rows):
        print(
            f"  rank {rank}: {wall * 1e3:.2f} ms per call, CPU user {user * 1e3:.2f} "
            f"system {system * 1e3:.2f} ms"
        )
    if shares:
        print("  perf samples: " + ", ".join(f"{k} {v:.1f}%" for k, v in shares.items()))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
