"""Local multi-process groups for tests: N ranks on loopback that run many test cases each.

The launcher is ``freescale_comm._local_ranks`` (the bench commands use the same one): starting
a rank costs seconds (importing torch on a small machine), so a ``LocalGroup`` starts its
processes once and then runs any number of functions on all ranks, each run bounded in time,
with every rank's own traceback when one raises, hangs or dies. ``LocalGroups`` keeps one started
group per configuration across tests; the tests that use it run in one test process per backend
(``tests/xdist_groups.py``), so each configuration starts once in a run.

Example::

    group = LocalGroup(world_size=2)
    results = group.run(my_module.check_allgather, 1024)   # one result per rank
    group.close()
"""

from __future__ import annotations

from typing import Any

from freescale_comm._local_ranks import GroupSpec, LocalGroup, RankFailure, run_ranks

__all__ = ["GroupSpec", "LocalGroup", "LocalGroups", "RankFailure", "run_ranks"]


class LocalGroups:
    """One started ``LocalGroup`` per configuration (``GroupSpec``), shared across tests.

    Configurations compare as specs, so ``init_timeout_s=60`` and the default (60 s) name the
    same group.
    """

    def __init__(self) -> None:
        self._groups: list[LocalGroup] = []

    def get(self, world_size: int, backend: str = "gloo", **spec: Any) -> LocalGroup:
        wanted = GroupSpec(world_size, backend, **spec)
        for group in self._groups:
            if group.spec == wanted:
                return group
        # Groups of another backend belong to tests already run: stop them so their ranks
        # (and their progress threads) do not compete with the new ones for a small machine.
        for group in self._groups:
            if group.spec.backend != backend:
                group.close()
        group = LocalGroup.of(wanted)
        self._groups.append(group)
        return group

    def close(self) -> None:
        for group in self._groups:
            group.close()
        self._groups.clear()


def reads_allowed() -> bool:
    """Whether ranks of one host may read each other's memory (Yama's ``ptrace_scope`` 0 or 1,
    or no Yama): the reads of large host messages and the set-up probe need it."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read()) <= 1
    except (OSError, ValueError):
        return True
