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

import os
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from freescale_comm._local_ranks import GroupSpec, LocalGroup, RankFailure, run_ranks

__all__ = [
    "GroupSpec",
    "LocalGroup",
    "LocalGroups",
    "RankFailure",
    "free_port",
    "run_ranks",
    "run_sessions",
]


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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a launcher's store)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_sessions(
    commands: Sequence[tuple[Sequence[str], Mapping[str, str] | None]], timeout_s: float
) -> list[tuple[int, str]]:
    """Runs each (command, environment) in a process session of its own, all at once; returns
    each one's exit status and merged stdout and stderr, waited for within ``timeout_s`` each.
    The sessions still running then are killed (torchrun's workers, a rank's children)."""
    processes = [
        subprocess.Popen(
            list(command),
            env=None if env is None else dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for command, env in commands
    ]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=timeout_s)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return [
        (process.returncode, output) for process, output in zip(processes, outputs, strict=True)
    ]
