"""How steady the set-up probe's choice between rings and reads is on this host.

With 4 KiB pages and no read helpers, a group's ranks measure the rings against the reads when
they set it up (``freescale_comm.host_probe``) and keep the verdict for later groups of the same
processes. This script sets up ``--repeats`` groups on ``--ranks`` local ranks, forgetting the
verdict before each, and reports each probe's figures: the median round through the rings and by
read (a round taking its slowest rank's time), their ratio, the choice, and how long rank 0's
probe took. Where the ratio sits near ``READS_WIN_BELOW`` the choice may flip between runs;
there the two paths cost about the same.

    python benchmarks/host_probe_repeat.py [--ranks 4] [--repeats 8] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

from freescale_comm import host_probe
from freescale_comm._local_ranks import GroupSpec, run_ranks_or_exit
from freescale_comm.host_probe import PROBE_BYTES, PROBE_ROUNDS, READS_WIN_BELOW
from freescale_comm.info import page_settings


def _rank(repeats: int) -> list[dict[str, Any]]:
    import torch.distributed as dist

    probes = []
    for _ in range(repeats):
        host_probe._verdicts.clear()
        group = dist.new_group(backend="freescale")
        verdict = next(iter(host_probe._verdicts.values()), None)
        if verdict is None:
            raise SystemExit(f"no probe ran: {group.paths()[0]['why']}")
        probes.append(
            {
                "rings_ms": verdict.rings_s * 1e3,
                "reads_ms": verdict.reads_s * 1e3,
                "ratio": verdict.reads_s / verdict.rings_s,
                "reads": verdict.reads,
                "probe_ms": verdict.measured_s * 1e3,
            }
        )
        dist.destroy_process_group(group)
    return probes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.ranks < 2 or args.repeats < 1:
        parser.error("--ranks must be at least 2 and --repeats at least 1")
    # No read helpers, and torch asks for no huge pages: else the group reads above 512 KiB by
    # rule and measures nothing (as where the kernel gives every tensor huge pages, "always").
    spec = GroupSpec(
        args.ranks,
        "gloo",
        init_timeout_s=120,
        setup="freescale_comm:register",
        env={"FREESCALE_HOST_COPY_THREADS": "1", "THP_MEM_ALLOC_ENABLE": "0"},
    )
    probes = run_ranks_or_exit(spec, _rank, args.repeats, timeout_s=600)[0]
    for k, probe in enumerate(probes):
        print(
            f"probe {k}: rings {probe['rings_ms']:.2f} ms, reads {probe['reads_ms']:.2f} ms, "
            f"ratio {probe['ratio']:.2f}: the {'reads' if probe['reads'] else 'rings'} "
            f"(the probe took {probe['probe_ms']:.0f} ms)"
        )
    ratios = [p["ratio"] for p in probes]
    chose_reads = sum(p["reads"] for p in probes)
    print(
        f"{args.ranks} ranks: reads/rings median {statistics.median(ratios):.2f} "
        f"(range {min(ratios):.2f}-{max(ratios):.2f}); the reads chosen {chose_reads} "
        f"of {len(probes)} (below {READS_WIN_BELOW})"
    )
    if args.json:
        report = {
            "args": vars(args),
            "probe": {
                "bytes": PROBE_BYTES,
                "rounds": PROBE_ROUNDS,
                "reads_win_below": READS_WIN_BELOW,
            },
            "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
            **page_settings(),
            "probes": probes,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
