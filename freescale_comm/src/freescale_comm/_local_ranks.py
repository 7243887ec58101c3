"""Local ranks on loopback: the one launcher of the tests, the bench commands and the benchmarks.

``LocalGroup`` starts ``world_size`` processes around a TCPStore that the parent owns (port 0:
the OS picks a free port, no race), joins them in one ``torch.distributed`` group, and then runs
any number of functions on every rank. Every run is bounded in time; a rank that
raises, hangs or dies fails the run with each rank's own traceback (a rank still running near
the deadline first dumps every thread's stack to stderr), and the group is torn down, so the next
run starts afresh. ``run_ranks`` is one run on a group of its own.

Shared by symbolic link (``freescale_comm`` and ``freescale_embed`` each install it, as
``_freescale_cli.py``): neither component depends on the other.

Example::

    results = run_ranks(GroupSpec(world_size=2), my_module.check_allgather, 1024)

``fn`` must be importable by module path (a module-level function) and reads its rank from
``torch.distributed``; its arguments and return value must pickle.

On a host without an NVIDIA GPU, ranks are forked from a ``multiprocessing`` fork server that has
imported torch once per launching process, instead of each spawned afresh to import it again
(seconds per rank on a small machine). Each rank still starts with the launching process's
environment and ``sys.path`` of the moment it starts, and initialises UCX, threads and sockets
itself, after the fork. Where a GPU is (``/dev/nvidiactl``), ranks are spawned: forked ones crashed
in their start (SIGSEGV while joining the group, 2 of 5 runs of the CUDA tests on the H200
machine). ``FREESCALE_RANK_START`` (``auto``, ``forkserver``, ``spawn``) overrides the choice.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

# How ranks start: "auto" (the default: see the module docstring), "forkserver" or "spawn".
RANK_START_ENV = "FREESCALE_RANK_START"
_START_METHODS = ("auto", "forkserver", "spawn")
_GPU_DEVICE_FILE = "/dev/nvidiactl"
# What the fork server imports before it forks any rank: only modules whose import starts no
# thread, opens no socket and leaves CUDA uninitialised (a forked child cannot use those), which
# torch, torch.distributed (and the freescale backend's registration, through torch's entry
# point) and this module are. This module by its own name: a rank unpickles ``_rank_main`` from it.
_FORK_SERVER_PRELOAD = ("torch", "torch.distributed", __name__)
# In a rank: its rank (``local_rank``) and the launcher store's port (``store_port``).
_RANK: int | None = None
_STORE_PORT: int | None = None


class RankFailure(AssertionError):
    """Some rank raised, timed out or died; the message holds every rank's report.

    Attributes:
        results: rank -> return value, for the ranks that finished normally (a killed-peer test
            checks what the survivors saw).
        failures: rank -> (kind, detail) for the others; kind is "error", "timeout", "died" or
            "stopped" (not waited for once another rank failed, with ``stop_on_error``).
    """

    def __init__(
        self, message: str, results: dict[int, Any], failures: dict[int, tuple[str, str]]
    ) -> None:
        super().__init__(message)
        self.results = results
        self.failures = failures


@dataclass(frozen=True)
class GroupSpec:
    """How each rank starts and builds its process group.

    Attributes:
        world_size: number of ranks.
        backend: ``torch.distributed`` backend name (``"gloo"``, ``"freescale"``, ...); ``None``:
            no group (the function joins one itself, on ``store_port()``).
        init_timeout_s: bound on joining the group and on its collectives (its ``timeout``).
        env: environment variables set in each rank before it joins its group (after torch's
            import in the fork server: a variable torch reads at import needs
            ``FREESCALE_RANK_START=spawn``; one it reads at its first CPU allocation, such as
            ``THP_MEM_ALLOC_ENABLE``, takes effect as long as the fork server allocates none).
        setup: optional ``"module:function"`` each rank calls before creating its group (e.g.
            ``"freescale_comm:register"``).
        threads: torch intra-op threads per rank (``OMP_NUM_THREADS`` too); ``None``: torch's
            default, one per core, as a training process has it.
        device: ``"cuda"``: rank r makes GPU ``r % device count`` current before its group.
        pg_options: ``pg_options`` of ``init_process_group`` (must pickle).
    """

    world_size: int
    backend: str | None = "gloo"
    init_timeout_s: float = 60.0
    env: Mapping[str, str] = field(default_factory=dict)
    setup: str | None = None
    threads: int | None = 1
    device: str = "cpu"
    pg_options: Any = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")


def store_port() -> int:
    """In a rank: the port of the launcher's TCPStore on 127.0.0.1."""
    if _STORE_PORT is None:
        raise RuntimeError("store_port() is only known in a rank that a LocalGroup started")
    return _STORE_PORT


def local_rank() -> int:
    """In a rank: its rank in the launcher's group, known before any process group exists."""
    if _RANK is None:
        raise RuntimeError("local_rank() is only known in a rank that a LocalGroup started")
    return _RANK


def _start_method() -> str:
    """The start method ``FREESCALE_RANK_START`` names (``auto`` where it is unset)."""
    method = os.environ.get(RANK_START_ENV, "auto")
    if method not in _START_METHODS:
        raise ValueError(f"{RANK_START_ENV} must be one of {_START_METHODS}, got {method!r}")
    if method == "auto":
        method = "spawn" if os.path.exists(_GPU_DEVICE_FILE) else "forkserver"
    if method == "forkserver" and "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    return method


@functools.cache
def _context(method: str) -> multiprocessing.context.BaseContext:
    """The context ranks start from; the fork server's preload is set once, before it starts."""
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(list(_FORK_SERVER_PRELOAD))
    return context


def _join_group(rank: int, spec: GroupSpec, port: int) -> None:
    import importlib

    import torch
    import torch.distributed as dist

    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    if spec.setup:
        module, _, name = spec.setup.partition(":")
        getattr(importlib.import_module(module), name)()
    if spec.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if spec.backend is None:
        return
    timeout = timedelta(seconds=spec.init_timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group(
        spec.backend,
        store=store,
        rank=rank,
        world_size=spec.world_size,
        timeout=timeout,
        pg_options=spec.pg_options,
    )


def _rank_main(
    rank: int,
    spec: GroupSpec,
    port: int,
    conn: multiprocessing.connection.Connection,
    environ: dict[str, str],
) -> None:
    global _RANK, _STORE_PORT
    _RANK, _STORE_PORT = rank, port
    # A rank that crashes (SIGSEGV in a native library) prints every thread's Python stack on
    # stderr, which the caller captures: its report alone says only "exited with code -11".
    faulthandler.enable(all_threads=True)
    # A forked rank inherits the fork server's environment, of when the server started: take the
    # launching process's of when this rank started instead, as a spawned rank has it.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(spec.env)
    if spec.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(spec.threads)
    try:
        _join_group(rank, spec, port)
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
        fn, args, kwargs, timeout_s = task
        # Every thread's stack on stderr if this run is still going just before the deadline.
        faulthandler.dump_traceback_later(max(1.0, 0.95 * timeout_s - 1.0), exit=False)
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        finally:
            faulthandler.cancel_dump_traceback_later()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class LocalGroup:
    """``world_size`` local processes joined in one ``torch.distributed`` group on loopback."""

    def __init__(self, world_size: int, backend: str | None = "gloo", **spec: Any) -> None:
        self.spec = GroupSpec(world_size, backend, **spec)
        self._processes: list[multiprocessing.Process] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._store: Any = None

    @classmethod
    def of(cls, spec: GroupSpec) -> LocalGroup:
        """A group built as ``spec`` says."""
        return cls(**{f.name: getattr(spec, f.name) for f in fields(spec)})

    @property
    def started(self) -> bool:
        return bool(self._processes)

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, in rank order (what they name their shared memory after)."""
        return [process.pid for process in self._processes]

    def start(self, timeout_s: float = 120.0) -> None:
        """Starts the ranks and waits until every one has joined the group."""
        import torch.distributed as dist

        context = _context(_start_method())
        self._store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        environ = dict(os.environ)
        for rank in range(self.spec.world_size):
            parent, child = context.Pipe()
            process = context.Process(
                target=_rank_main,
                args=(rank, self.spec, self._store.port, child, environ),
                name=f"freescale-rank{rank}",
                daemon=True,
            )
            process.start()
            child.close()
            self._processes.append(process)
            self._conns.append(parent)
        self._collect("start", timeout_s, stop_on_error=False)

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout_s: float = 60.0,
        stop_on_error: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank; returns the per-rank results in rank order.

        Args:
            fn: a module-level function.
            args: its arguments.
            timeout_s: bound on the run.
            stop_on_error: stop waiting for the other ranks once one failed (its peers may be
                blocked in a collective it never joins); otherwise every rank is waited for.
            kwargs: its keyword arguments.

        Raises:
            RankFailure: a rank raised, did not finish within ``timeout_s``, or died. The group
                is closed; the next run starts it again.
        """
        if not self.started:
            self.start()
        for conn in self._conns:
            conn.send((fn, args, kwargs, timeout_s))
        return self._collect(getattr(fn, "__qualname__", repr(fn)), timeout_s, stop_on_error)

    def _reply_of(self, rank: int) -> tuple[str, Any]:
        """The reply of a rank whose pipe or process signalled: its message, or how it died."""
        # A rank's last reply may still be queued when its process has already ended.
        try:
            return self._conns[rank].recv()
        except EOFError:
            process = self._processes[rank]
            process.join(10)  # the pipe closes a moment before the exit code can be read
            return ("died", f"process exited with code {process.exitcode}")

    def _collect(self, what: str, timeout_s: float, stop_on_error: bool) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        replies: dict[int, tuple[str, Any]] = {}
        by_conn = {conn: rank for rank, conn in enumerate(self._conns)}
        by_sentinel = {p.sentinel: rank for rank, p in enumerate(self._processes)}
        stopped = False
        while len(replies) < len(self._conns) and not stopped:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            pending = [c for c, r in by_conn.items() if r not in replies]
            sentinels = [s for s, r in by_sentinel.items() if r not in replies]
            for ready in multiprocessing.connection.wait(pending + sentinels, remaining):
                rank = by_conn[ready] if ready in by_conn else by_sentinel[ready]
                if rank not in replies:
                    replies[rank] = self._reply_of(rank)
                    stopped = stop_on_error and replies[rank][0] != "ok"
        if len(replies) == len(self._conns) and all(k == "ok" for k, _ in replies.values()):
            return [replies[rank][1] for rank in range(len(self._conns))]
        missing = ("stopped", "not waited for: another rank failed") if stopped else None
        results, failures = {}, {}
        for rank in range(len(self._conns)):
            timeout = ("timeout", f"no answer within {timeout_s:.0f} s")
            kind, detail = replies.get(rank, missing or timeout)
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


def run_ranks(
    spec: GroupSpec,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 600.0,
    stop_on_error: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """``fn(*args, **kwargs)`` once on every rank of a group of its own; the per-rank results.

    Raises:
        RankFailure: as ``LocalGroup.run``; by default the first failing rank ends the run.
    """
    group = LocalGroup.of(spec)
    try:
        group.start(timeout_s)
        return group.run(fn, *args, timeout_s=timeout_s, stop_on_error=stop_on_error, **kwargs)
    finally:
        group.close()


def run_ranks_or_exit(
    spec: GroupSpec, fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0, **kwargs: Any
) -> list[Any]:
    """``run_ranks`` for a command line: a failing rank ends the program with its report
    (``SystemExit``) instead of a traceback of the launcher."""
    try:
        return run_ranks(spec, fn, *args, timeout_s=timeout_s, **kwargs)
    except RankFailure as failure:
        raise SystemExit(f"a rank failed: {failure}") from None


class Replies:
    """The queue a reporting target puts its replies on, in ``run_reporting_ranks``."""

    def __init__(self) -> None:
        self.items: list[tuple[Any, ...]] = []

    def put(self, item: tuple[Any, ...]) -> None:
        self.items.append(item)


def _reporting_rank(target: Callable[..., None], args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    replies = Replies()
    rank = local_rank()
    target(rank, store_port(), replies, *args)
    errors = [item[-1] for item in replies.items if item[-2] != "ok"]
    if errors:
        raise RuntimeError(f"rank {rank} reported an error:\n{errors[0]}")
    return replies.items


def run_reporting_ranks(
    target: Callable[..., None],
    world_size: int,
    args: tuple[Any, ...],
    timeout_s: float,
    *,
    stop_on_error: bool = True,
) -> dict[int, list[tuple[Any, ...]]]:
    """Runs a target that joins its group itself and reports on a queue, on ``run_ranks``.

    The target is called as ``target(rank, port, queue, *args)`` with the launcher store's
    port, and reports with ``queue.put((..., kind, payload))``, ``kind`` ``"ok"`` or
    ``"error"``.

    Returns:
        Per rank, the replies it put; a rank that failed or timed out gets ``[(kind, why)]``
        and a rank not waited for once another failed (``stop_on_error``) is left out.
    """
    spec = GroupSpec(world_size, backend=None, threads=None)
    try:
        per_rank = run_ranks(
            spec,
            _reporting_rank,
            target,
            args,
            timeout_s=timeout_s,
            stop_on_error=stop_on_error,
        )
        return dict(enumerate(per_rank))
    except RankFailure as failure:
        replies = dict(failure.results)
        for rank, (kind, detail) in failure.failures.items():
            if kind != "stopped":
                replies[rank] = [(kind, detail)]
        return replies
