"""Local multi-process groups for tests: N ranks on loopback that run many test cases each.

Starting a rank costs seconds (importing torch on a small machine), so a ``LocalGroup`` starts its
processes once and then runs any number of functions on all ranks. Every run is bounded in time;
a rank that raises, hangs or dies fails the run with each rank's own traceback, and the group is
torn down and started afresh for the next run, so one broken case never poisons the next.

Example::

    group = LocalGroup(world_size=2)
    results = group.run(my_module.check_allgather, 1024)   # one result per rank
    group.close()

``fn`` must be importable by module path (a module-level function) and reads its rank from
``torch.distributed``; its arguments and return value must pickle.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

_SPAWN = multiprocessing.get_context("spawn")


class RankFailure(AssertionError):
    """Some rank raised, timed out or died; the message holds every rank's report.

    Attributes:
        results: rank -> return value, for the ranks that finished normally (a killed-peer test
            checks what the survivors saw).
        failures: rank -> (kind, detail) for the others; kind is "error", "timeout" or "died".
    """

    def __init__(
        self, message: str, results: dict[int, Any], failures: dict[int, tuple[str, str]]
    ) -> None:
        super().__init__(message)
        self.results = results
        self.failures = failures


@dataclass
class GroupSpec:
    """How to build the process group of each rank.

    Attributes:
        world_size: number of ranks.
        backend: ``torch.distributed`` backend name (``"gloo"``, ``"freescale"``, ...).
        init_timeout_s: bound on the group's own collectives (its ``timeout``).
        env: environment variables set in each rank before anything is imported.
        setup: optional ``"module:function"`` each rank calls before creating its group (e.g. to
            register a backend).
    """

    world_size: int
    backend: str = "gloo"
    init_timeout_s: float = 60.0
    env: Mapping[str, str] = field(default_factory=dict)
    setup: str | None = None


def _rank_main(rank: int, spec: GroupSpec, port: int, conn: multiprocessing.connection.Connection):
    os.environ.update(spec.env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import importlib

    import torch

    torch.set_num_threads(1)
    try:
        if spec.setup:
            module, _, name = spec.setup.partition(":")
            getattr(importlib.import_module(module), name)()
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            is_master=False,
            timeout=timedelta(seconds=spec.init_timeout_s),
        )
        dist.init_process_group(
            spec.backend,
            store=store,
            rank=rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.init_timeout_s),
        )
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            task = conn.recv()
        except EOFError:
            break
        if task is None:
            break
        fn, args, kwargs = task
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    if dist.is_initialized():
        dist.destroy_process_group()


class LocalGroup:
    """``world_size`` local processes joined in one ``torch.distributed`` group on loopback."""

    def __init__(self, world_size: int, backend: str = "gloo", **spec: Any) -> None:
        self.spec = GroupSpec(world_size, backend, **spec)
        self._processes: list[multiprocessing.Process] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._store: dist.TCPStore | None = None

    @property
    def started(self) -> bool:
        return bool(self._processes)

    def start(self, timeout_s: float = 120.0) -> None:
        """Starts the ranks and waits until every one has joined the group."""
        # The parent owns the store: port 0 lets the OS pick a free port with no race.
        self._store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        for rank in range(self.spec.world_size):
            parent, child = _SPAWN.Pipe()
            process = _SPAWN.Process(
                target=_rank_main,
                args=(rank, self.spec, self._store.port, child),
                name=f"freescale-test-rank{rank}",
                daemon=True,
            )
            process.start()
            child.close()
            self._processes.append(process)
            self._conns.append(parent)
        self._collect("start", timeout_s)

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0, **kwargs: Any
    ) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank; returns the per-rank results in rank order.

        Raises:
            RankFailure: a rank raised, did not finish within ``timeout_s``, or died. The group is
                restarted before the next run.
        """
        if not self.started:
            self.start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return self._collect(getattr(fn, "__qualname__", repr(fn)), timeout_s)

    def _reply_of(self, rank: int) -> tuple[str, Any]:
        """The reply of a rank whose pipe or process signalled: its message, or how it died."""
        # A rank's last reply may still be queued when its process has already ended.
        try:
            return self._conns[rank].recv()
        except EOFError:
            process = self._processes[rank]
            process.join(10)  # the pipe closes a moment before the exit code can be read
            return ("died", f"process exited with code {process.exitcode}")

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        replies: dict[int, tuple[str, Any]] = {}
        by_conn = {conn: rank for rank, conn in enumerate(self._conns)}
        by_sentinel = {p.sentinel: rank for rank, p in enumerate(self._processes)}
        while len(replies) < len(self._conns):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            pending = [c for c, r in by_conn.items() if r not in replies]
            sentinels = [s for s, r in by_sentinel.items() if r not in replies]
            for ready in multiprocessing.connection.wait(pending + sentinels, remaining):
                rank = by_conn[ready] if ready in by_conn else by_sentinel[ready]
                if rank not in replies:
                    replies[rank] = self._reply_of(rank)
        if len(replies) == len(self._conns) and all(k == "ok" for k, _ in replies.values()):
            return [replies[rank][1] for rank in range(len(self._conns))]
        results, failures = {}, {}
        for rank in range(len(self._conns)):
            kind, detail = replies.get(rank, ("timeout", f"no answer within {timeout_s:.0f} s"))
            if kind == "ok":
                results[rank] = detail
            else:
                failures[rank] = (kind, detail)
        self.close()
        reports = [
            f"--- rank {r}: {kind} ---\n{detail}".rstrip() for r, (kind, detail) in failures.items()
        ]
        raise RankFailure(
            f"{what} failed on {len(failures)} rank(s):\n" + "\n".join(reports), results, failures
        )

    def close(self) -> None:
        """Stops every rank (politely, then by force) and releases the store's port."""
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)
        deadline = time.monotonic() + 5
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5)
        for conn in self._conns:
            conn.close()
        self._processes, self._conns, self._store = [], [], None

    def __enter__(self) -> LocalGroup:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalGroups:
    """One started ``LocalGroup`` per (world size, backend, options), shared across tests."""

    def __init__(self) -> None:
        self._groups: dict[tuple, LocalGroup] = {}

    def get(self, world_size: int, backend: str = "gloo", **spec: Any) -> LocalGroup:
        key = (world_size, backend, tuple(sorted((k, repr(v)) for k, v in spec.items())))
        if key not in self._groups:
            # Groups of another backend belong to tests already run: stop them so their ranks
            # (and their progress threads) do not compete with the new ones for a small machine.
            for other_key, group in self._groups.items():
                if other_key[1] != backend:
                    group.close()
            self._groups[key] = LocalGroup(world_size, backend, **spec)
        return self._groups[key]

    def close(self) -> None:
        for group in self._groups.values():
            group.close()
        self._groups.clear()
