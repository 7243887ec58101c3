"""A longer run of ``ranks.concurrent_random_cases`` than the test suite's, to hunt rare bugs.

    python -m tests.comm.soak --ranks 4 --seeds 21-26 --rounds 100 --threads 3 --hosts 2 \
        [FREESCALE_OPTION=value ...]

Each seed is a fresh group of local ranks on loopback; the first failure ends the run.
"""

from __future__ import annotations

import argparse
import sys
import time

from freescale_comm._local_ranks import LocalGroup
from tests.comm import ranks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seeds", default="1-5", help="first-last")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-elements", type=int, default=2_000_000)
    parser.add_argument("--hosts", type=int, default=1, help="pretend hosts")
    parser.add_argument("env", nargs="*", help="FREESCALE_...=value for every rank")
    args = parser.parse_args(argv)
    first, _, last = args.seeds.partition("-")
    env = dict(item.split("=", 1) for item in args.env)
    for seed in range(int(first), int(last or first) + 1):
        group = LocalGroup(
            args.ranks, backend="freescale", setup="freescale_comm:register", env=env
        )
        began = time.monotonic()
        try:
            group.start()
            checked = group.run(
                ranks.concurrent_random_cases,
                seed,
                args.rounds,
                args.threads,
                args.max_elements,
                args.hosts,
                timeout_s=600,
            )
        finally:
            group.close()
        print(f"seed {seed}: {checked[0]} collectives checked in {time.monotonic() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
