"""When each chunk of one staged CUDA AllToAll is queued, on both ranks (2 local ranks).

A diagnostic of this code, not a comparison: it wraps the staging rings' copy calls
(``cuda.RingCopies.copy_in`` / ``copy_out``: a D2H into a ring slot, an H2D out of one), the
first ``done`` that finds a copy finished, and the collective's phases (``_judge``,
``_start_data``, ``_complete``, ``_finish``, ``_finish_after_final``), and prints, for two of
8 calls (each after a barrier), every mark of both ranks in microseconds from the earlier
rank's call, with the host time each queueing call took. Both ranks read one monotonic clock.

    python3 benchmarks/comm_staged_timeline.py [--mib 64] [--cap 64]    # one GPU (or more)

``--cap`` sets ``shm.Channel.DEVICE_CHUNKS_PER_PUSH`` in both ranks (64: every free slot at
once, what the rings did before that setting).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from freescale_comm._local_ranks import run_ranks

# (mark, start, end or 0, bytes or sequence number)
_MARKS: list[tuple[str, float, float, int]] = []


def _install() -> None:
    """Wraps the copy calls and phases named in the module docstring."""
    from freescale_comm import collective, cuda

    rings = cuda.RingCopies
    copy_in, copy_out = rings.copy_in, rings.copy_out
    done = rings.__dict__["done"].__func__
    finished: set[int] = set()

    def marked_in(self: Any, slot: Any, request: Any, offset: int, n: int) -> Any:
        start = time.perf_counter()
        token = copy_in(self, slot, request, offset, n)
        _MARKS.append(("d2h queued", start, time.perf_counter(), n))
        return token

    def marked_out(self: Any, request: Any, offset: int, slot: Any) -> Any:
        start = time.perf_counter()
        token = copy_out(self, request, offset, slot)
        _MARKS.append(("h2d queued", start, time.perf_counter(), len(slot)))
        return token

    def marked_done(token: Any) -> bool:
        result = done(token)
        if result and id(token) not in finished:
            finished.add(id(token))
            _MARKS.append(("a copy seen done", time.perf_counter(), 0.0, 0))
        return result

    rings.copy_in, rings.copy_out, rings.done = marked_in, marked_out, staticmethod(marked_done)
    for name in ("_judge", "_start_data", "_complete", "_finish", "_finish_after_final"):
        original = getattr(collective.Collective, name)

        def phase(self: Any, *args: Any, original: Any = original, name: str = name) -> Any:
            _MARKS.append((name, time.perf_counter(), 0.0, self.seq))
            return original(self, *args)

        setattr(collective.Collective, name, phase)


def _rank(nbytes: int, cap: int | None) -> tuple[list[tuple[float, float, float]], list[Any]]:
    """One rank: (call, return, done) times of 8 calls, and every mark."""
    import torch
    import torch.distributed as dist

    from freescale_comm import shm

    if cap is not None:
        shm.Channel.DEVICE_CHUNKS_PER_PUSH = cap

    inp = torch.ones(nbytes // 4, device="cuda")
    out = torch.empty_like(inp)
    for _ in range(5):
        dist.all_to_all_single(out, inp)
    torch.cuda.synchronize()
    _install()
    dist.barrier()
    torch.cuda.synchronize()
    calls = []
    for _ in range(8):
        start = time.perf_counter()
        dist.all_to_all_single(out, inp)
        returned = time.perf_counter()
        torch.cuda.synchronize()
        calls.append((start, returned, time.perf_counter()))
        dist.barrier()
    return calls, list(_MARKS)


def main() -> int:
    """Runs the two ranks and prints the timelines of calls 4 and 6; 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB per rank")
    parser.add_argument("--cap", type=int, help="device chunks a ring queues per progress call")
    args = parser.parse_args()
    from comm_staged_push import staged_pair  # beside this file

    (calls0, marks0), (calls1, marks1) = run_ranks(
        staged_pair(), _rank, args.mib << 20, args.cap, timeout_s=200
    )
    print("rank 0, call to done, ms:", [round((c[2] - c[0]) * 1e3, 2) for c in calls0])
    for k in (4, 6):
        origin = min(calls0[k][0], calls1[k][0])
        end = max(calls0[k][2], calls1[k][2])
        print(
            f"--- call {k}: starts r0 {1e6 * (calls0[k][0] - origin):.0f} us, "
            f"r1 {1e6 * (calls1[k][0] - origin):.0f} us; done r0 "
            f"{1e6 * (calls0[k][2] - origin):.0f}, r1 {1e6 * (calls1[k][2] - origin):.0f}"
        )
        rows = [
            (1e6 * (t - origin), rank, name, 1e6 * (t_end - t) if t_end else 0.0, n)
            for rank, marks in ((0, marks0), (1, marks1))
            for name, t, t_end, n in marks
            if origin <= t <= end
        ]
        print(f"{'us':>9} rank {'mark':<20} {'host us':>7} bytes/seq")
        for t, rank, name, took, n in sorted(rows):
            print(f"{t:9.0f}  r{rank}  {name:<20} {took:7.0f} {n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
