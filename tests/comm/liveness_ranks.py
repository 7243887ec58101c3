"""Rank-side functions of the liveness tests (run in every rank by ``tests.harness.LocalGroup``)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from freescale_comm import FreescaleOptions
from freescale_comm.errors import FreescaleTimeoutError


def _poll(work: dist.Work) -> None:
    """Polls ``work`` until it is completed, as a caller's own loop does instead of waiting,
    then raises its error, if any."""
    while not work.is_completed():
        time.sleep(1e-3)
    if not work.is_success():
        raise work.exception()


def polled_collective_is_forgotten_once_done() -> dict[str, Any]:
    """An AllReduce on the group's Gloo backend that rank 0 polls (rank 1 calls it 0.3 s late):
    how many polled works rank 0's group counted while it ran, and after its completion and
    two upkeeps (each second); its sum."""
    from tests.comm.ranks import freescale_group

    rank = dist.get_rank()
    group = freescale_group(30)
    x = torch.full((4,), float(rank + 1))
    if rank == 1:
        time.sleep(0.3)
    work = dist.all_reduce(x, group=group, async_op=True)
    counted = []
    while not work.is_completed():
        counted.append(len(group._ctx._gloo_polls))
        time.sleep(1e-3)
    error = work.exception()
    time.sleep(2.2)
    left = len(group._ctx._gloo_polls)
    dist.destroy_process_group(group)
    return {
        "counted": max(counted, default=0),
        "left": left,
        "sum": x.tolist(),
        "error": None if error is None else repr(error),
    }


def _loop_until_error(group: dist.ProcessGroup | None, what: str, op: str = "all_to_all") -> float:
    """Runs collectives until one raises; re-raises with the time it took. ``op``: the group's
    own AllToAll, or ``all_reduce`` (``all_reduce_polled``: polled, never waited for) /
    ``barrier`` / a step of a small DDP model (whose backward waits on its allreduce's future)
    / a ring of sends and receives (from the previous rank, or from any source) / sends never
    waited for, which the group delegates to Gloo."""
    n = dist.get_world_size(group)
    x = torch.ones(n * 64)
    if op == "ddp":
        model = _ddp_model(group)

        def step() -> None:
            _ddp_step(model, x.view(n, 64), group)

    elif op in ("send_recv", "recv_any"):
        rank = dist.get_rank(group)
        received, summed = torch.empty_like(x), torch.empty_like(x)
        source = None if op == "recv_any" else (rank - 1) % n

        def step() -> None:
            # With an AllReduce on Gloo beside it, which the abort's failure of Gloo's pairs
            # reaches too: its wait must raise the abort's error, not Gloo's.
            reduced = dist.all_reduce(summed, group=group, async_op=True)
            sent = dist.isend(x, (rank + 1) % n, group=group)
            try:
                dist.recv(received, source, group=group)
                sent.wait()
            except RuntimeError as err:
                try:
                    reduced.wait()
                except RuntimeError as beside:
                    raise RuntimeError(f"{err} [all_reduce: {type(beside).__name__}]") from err
                raise
            reduced.wait()

    elif op == "isend":
        rank = dist.get_rank(group)

        def step() -> None:
            dist.isend(x, (rank + 1) % n, group=group)

    else:
        step = {
            "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(x), x, group=group),
            "all_reduce": lambda: dist.all_reduce(x, group=group),
            "all_reduce_polled": lambda: _poll(dist.all_reduce(x, group=group, async_op=True)),
            "barrier": lambda: dist.barrier(group=group),
        }[op]
    start = time.monotonic()
    try:
        for _ in range(10_000_000):
            step()
    except Exception as err:
        raise RuntimeError(f"{what} raised after {time.monotonic() - start:.1f} s: {err}") from err
    return time.monotonic() - start


def _ddp_step(model: torch.nn.Module, x: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """One step of ``model``, whose backward waits on its AllReduce's future: Gloo's, which
    fails with Gloo's error once the group is aborted; the error raised names the cause as
    the group's next call does."""
    try:
        model(x).sum().backward()
    except RuntimeError as err:
        raise RuntimeError(f"{err} [next: {_error_of(lambda: dist.barrier(group))}]") from err


def _ddp_model(group: dist.ProcessGroup | None) -> torch.nn.Module:
    """A small DDP model (made on every rank at once: its parameters are broadcast)."""
    torch.manual_seed(0)
    return torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 1), process_group=group)


def stop_during_collective(victim: int, delay_s: float, op: str = "all_to_all") -> float:
    """The victim stops itself (SIGSTOP: alive, silent) while the others run ``op``
    (``_loop_until_error``); they must raise naming it. Once every survivor has raised,
    survivor 0 resumes the victim (SIGCONT), so that the run ends then and not at its bound."""
    from freescale_comm._local_ranks import store_port

    rank, n = dist.get_rank(), dist.get_world_size()
    pids: list[int | None] = [None] * n
    dist.all_gather_object(pids, os.getpid())
    dist.barrier()
    if rank == victim:
        if op == "ddp":
            _ddp_model(None)
        time.sleep(delay_s)
        os.kill(os.getpid(), signal.SIGSTOP)
        return 0.0
    try:
        return _loop_until_error(None, f"survivor {rank}", op)
    finally:
        store = dist.TCPStore(
            "127.0.0.1", store_port(), is_master=False, timeout=timedelta(seconds=30)
        )
        store.add("survivors_raised", 1)
        if rank == 0:
            deadline = time.monotonic() + 30
            while store.add("survivors_raised", 0) < n - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(pids[victim], signal.SIGCONT)


def abort_during_collective(
    aborter: int, delay_s: float, op: str = "all_to_all"
) -> dict[str, object]:
    """One rank calls ``abort()`` on a freescale subgroup the others are using for ``op``
    (``_loop_until_error``; short liveness periods, as ``FAST_FAILURE_ENV`` gives a world);
    every rank then destroys it, and the world must still work. Returns the rank's error
    message (the aborter: ``None``), that of an ``all_reduce`` it calls after it (``later``),
    and the world's AllGather after it."""
    from freescale_comm import FreescaleOptions

    rank = dist.get_rank()
    options = FreescaleOptions(heartbeat_s=0.5, dead_after_s=3.0)
    group = dist.new_group(backend="freescale", timeout=timedelta(seconds=60), pg_options=options)
    out = torch.empty(dist.get_world_size())
    dist.all_gather_into_tensor(out, torch.tensor([float(rank)]), group=group)
    dist.barrier()
    error = later = None
    if rank == aborter:
        time.sleep(delay_s)
        group.abort()
    else:
        error = _error_of(lambda: _loop_until_error(group, f"rank {rank}", op))
        later = _error_of(lambda: dist.all_reduce(torch.ones(1), group=group))
    dist.destroy_process_group(group)
    dist.all_gather_into_tensor(out, torch.tensor([float(rank)]))
    return {"error": error, "later": later, "world": out.tolist()}


def dead_peer_in_one_of_two_groups(victim: int, rounds: int) -> dict[str, object]:
    """Two disjoint freescale subgroups {0, 1} and {2, 3} live at once; the victim (in the
    second) dies: the first keeps working, the victim's group-mate raises naming it."""
    rank = dist.get_rank()
    first = dist.new_group([0, 1], backend="freescale", timeout=timedelta(seconds=60))
    second = dist.new_group([2, 3], backend="freescale", timeout=timedelta(seconds=60))
    mine = first if rank in (0, 1) else second
    out = torch.empty(2)
    dist.all_gather_into_tensor(out, torch.tensor([float(rank)]), group=mine)
    dist.barrier()
    if rank == victim:
        os._exit(9)
    if mine is second:
        error = _error_of(lambda: _loop_until_error(second, f"rank {rank}"))
        on_gloo = _error_of(lambda: dist.all_reduce(torch.ones(1), group=second))
        return {"error": error, "on_gloo": on_gloo}
    # The first group outlives dead_after_s of the victim's silence (3 s), and keeps working.
    start = time.monotonic()
    for done in range(rounds):
        dist.all_gather_into_tensor(out, torch.tensor([float(rank + done)]), group=first)
        expected = [float(r + done) for r in (0, 1)]
        if out.tolist() != expected:
            raise AssertionError(f"round {done}: {out.tolist()} != {expected}")
        time.sleep(0.01)
    return {"rounds": rounds, "seconds": time.monotonic() - start}


def _error_of(call) -> str:
    try:
        call()
    except RuntimeError as err:
        return str(err)
    return ""


def reinit_twice(rounds: int) -> list[float]:
    """Destroys the world group and makes it again from the same store, twice; each
    incarnation runs collectives (the same c10d prefix must not hand it stale keys)."""
    from freescale_comm.group import root_store

    rank, n = dist.get_rank(), dist.get_world_size()
    server = root_store(dist.distributed_c10d._get_default_store())
    # A client of the same store, unprefixed like the one the world was first made from: the
    # new world gets the same c10d prefix as the old one.
    store = dist.TCPStore(server.host, server.port, is_master=False, timeout=timedelta(seconds=60))
    sums = []
    for _ in range(2):
        dist.destroy_process_group()
        dist.init_process_group(
            "freescale", store=store, rank=rank, world_size=n, timeout=timedelta(seconds=60)
        )
        for r in range(rounds):
            out = torch.empty(n)
            dist.all_gather_into_tensor(out, torch.tensor([float(rank + r)]))
            got = torch.empty(n)
            dist.all_to_all_single(got, torch.full((n,), float(rank)))
            if got.tolist() != [float(p) for p in range(n)]:
                raise AssertionError(f"all_to_all after re-init: {got.tolist()}")
        sums.append(float(out.sum()))
    return sums


def busy_but_alive(pause: str, seconds: float, hosts: int) -> list[float]:
    """A freescale subgroup judging heartbeats after 1 s of silence (its ranks on ``hosts``
    pretend hosts), then one rank busy for ``seconds`` without beating on its own:
    ``late_new_group``, rank 0 waits in the store for rank 1's late ``new_group`` (the
    heartbeat's requests queued behind that wait on a shared connection); ``gil``, rank 0 holds
    the GIL in one C call (no Python thread of it runs). The AllGather after must work. Returns
    it."""
    import ctypes

    from freescale_comm import FreescaleOptions
    from freescale_comm.options import HOST_ENV

    rank, n = dist.get_rank(), dist.get_world_size()
    os.environ[HOST_ENV] = f"busy-host-{rank * hosts // n}"
    options = FreescaleOptions(heartbeat_s=0.2, dead_after_s=1.0)
    group = dist.new_group(backend="freescale", timeout=timedelta(seconds=60), pg_options=options)
    del os.environ[HOST_ENV]
    out = torch.empty(n)
    dist.all_gather_into_tensor(out, torch.tensor([float(rank)]), group=group)
    late = None
    if pause == "late_new_group":
        if rank == 1:
            time.sleep(seconds)
        late = dist.new_group(backend="gloo")
    elif rank == 0:
        ctypes.PyDLL(None).sleep(int(seconds))  # libc's sleep, called with the GIL held
    dist.all_gather_into_tensor(out, torch.tensor([float(rank + 1)]), group=group)
    dist.destroy_process_group(group)
    if late is not None:
        # Only now: a Gloo group destroyed at once can close its connections while the peer
        # still makes them (the peer's new_group then raises).
        dist.destroy_process_group(late)
    return out.tolist()


def _job_store_on_rank_0(name: str, timeout_s: float) -> tuple[int, Any, Any, Any]:
    """(this rank, the launcher's store, the job's store server on rank 0 (None elsewhere), a
    client of it): a job whose store rank 0 hosts, as under ``env://``; ``name`` is the
    launcher's key for its port."""
    from freescale_comm._local_ranks import local_rank, store_port

    rank = local_rank()
    launcher = dist.TCPStore(
        "127.0.0.1", store_port(), is_master=False, timeout=timedelta(seconds=30)
    )
    server = None
    if rank == 0:
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        launcher.set(name, str(server.port))
    port = int(launcher.get(name))
    job = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return rank, launcher, server, job


def outlive_the_store(stall_s: float) -> dict[str, object]:
    """Rank 0 hosts the job's store and leaves it (its part of the job done) once the pair
    {1, 2} made a freescale group judging liveness after 1 s. The pair then runs 300 AllGathers
    10 ms apart (they must work: no peer died), then rank 2 stalls ``stall_s`` before its next call:
    rank 1's call must fail once it has waited 1 s, since without the store it cannot tell a
    dead peer. Returns, per rank, the calls that worked and the error."""
    from freescale_comm import FreescaleOptions

    rank, launcher, server, job = _job_store_on_rank_0("job_store_port", 30)
    dist.init_process_group("gloo", store=job, rank=rank, world_size=3)
    options = FreescaleOptions(heartbeat_s=0.2, dead_after_s=1.0)
    pair = dist.new_group([1, 2], backend="freescale", pg_options=options)
    if rank == 0:
        while launcher.add("pair_ready", 0) < 2:  # a non-member's new_group does not wait
            time.sleep(0.01)
        dist.destroy_process_group()
        del job, server  # the store's server goes with the last reference
        launcher.set("store_gone", "1")
        return {"calls": 0, "error": None}
    launcher.add("pair_ready", 1)
    launcher.wait(["store_gone"])
    out = torch.empty(2)
    calls, error = 0, None
    try:
        for _ in range(300):  # 3 s and more: the store down for longer than dead_after_s
            dist.all_gather_into_tensor(out, torch.tensor([float(rank)]), group=pair)
            calls += 1
            time.sleep(0.01)
        if rank == 2:
            time.sleep(stall_s)
        dist.all_gather_into_tensor(out, torch.tensor([float(rank)]), group=pair)
    except RuntimeError as err:
        error = str(err)
    return {"calls": calls, "error": error}


def store_host_stopped(
    stop_after_s: float, resume_after_s: float, op: str = "all_to_all"
) -> dict[str, object]:
    """Rank 0 hosts the job's store and stops itself (SIGSTOP) during the calls of a
    freescale group judging liveness after 2 s (its AllToAll, or ``all_reduce`` (also waited
    for in slices, or polled) / a ``send_recv`` exchange / a step of a small DDP model on its
    Gloo backend): rank 1's
    requests to the store then go unanswered (no connection error), as with a store host cut
    off. Rank 1 must still raise
    within about ``dead_after_s``, not once the store answers again; it resumes rank 0 once
    it has raised, or after ``resume_after_s`` if it has not by then (so that the run ends).
    Returns, per rank, the seconds from the stop to the raise and the error."""
    import threading

    from freescale_comm import FreescaleOptions

    # The server (rank 0) lives as long as this function holds it.
    rank, launcher, _server, job = _job_store_on_rank_0("stopped_store_port", 60)
    if rank == 0:
        launcher.set("stopped_store_pid", str(os.getpid()))
    dist.init_process_group("gloo", store=job, rank=rank, world_size=2)
    options = FreescaleOptions(heartbeat_s=0.5, dead_after_s=2.0)
    group = dist.new_group(backend="freescale", timeout=timedelta(seconds=60), pg_options=options)
    model = _ddp_model(group) if op == "ddp" else None  # (its set-up before the stop)
    dist.barrier(group=group)
    if rank == 0:
        threading.Timer(stop_after_s, os.kill, (os.getpid(), signal.SIGSTOP)).start()
    else:
        stopped_at = time.monotonic() + stop_after_s
        victim = int(launcher.get("stopped_store_pid"))
        resume = threading.Timer(stop_after_s + resume_after_s, os.kill, (victim, signal.SIGCONT))
        resume.start()
    error = None
    x = torch.ones(2 * 64)

    def call() -> None:
        if model is not None:  # its backward waits on its allreduce's future
            _ddp_step(model, x.view(2, 64), group)
        elif op == "all_reduce":
            dist.all_reduce(x, group=group)
        elif op == "all_reduce_sliced":  # waited for in slices, as a caller that polls does
            work = dist.all_reduce(x, group=group, async_op=True)
            while True:
                with contextlib.suppress(FreescaleTimeoutError):
                    work.wait(timedelta(seconds=0.5))
                    return
        elif op == "all_reduce_polled":
            _poll(dist.all_reduce(x, group=group, async_op=True))
        elif op == "send_recv":
            sent = dist.isend(x, 1 - rank, group=group)
            dist.recv(torch.empty_like(x), 1 - rank, group=group)
            sent.wait()
        else:
            dist.all_to_all_single(torch.empty_like(x), x, group=group)

    try:
        for _ in range(10_000_000):
            call()
    except RuntimeError as err:
        error = str(err)
    raised_after = None
    if rank == 1:
        raised_after = time.monotonic() - stopped_at
        resume.cancel()
        os.kill(victim, signal.SIGCONT)
    launcher.add("stopped_store_done", 1)
    while launcher.add("stopped_store_done", 0) < 2:  # the store's host leaves last
        time.sleep(0.05)
    return {"raised_after_s": raised_after, "error": error}


def exit_right_after_a_timeout() -> str:
    """Rank 0's collective times out (rank 1 has not called it) and rank 0 exits at once
    (``os._exit``, as some launchers do after an error): its abort key must be in the store by
    then. Rank 1 calls the collective later and returns its error, which must name rank 0's
    timeout (not only that rank 0's process exited)."""
    rank = dist.get_rank()
    options = FreescaleOptions(heartbeat_s=0.5, dead_after_s=30.0)
    group = dist.new_group(backend="freescale", timeout=timedelta(seconds=3), pg_options=options)
    dist.barrier(group=group)
    x = torch.ones(8)
    if rank == 0:
        with contextlib.suppress(RuntimeError):
            dist.all_to_all_single(torch.empty_like(x), x, group=group)
        os._exit(3)
    time.sleep(5)
    try:
        dist.all_to_all_single(torch.empty_like(x), x, group=group)
    except RuntimeError as err:
        return str(err)
    return "no error"


def exit_right_after_a_timeout_taking_the_store() -> str:
    """``exit_right_after_a_timeout`` where rank 0 hosts the job's store, which leaves with it
    before rank 1's liveness may have read the abort key there."""
    rank, _launcher, _server, job = _job_store_on_rank_0("exit_store_port", 30)
    dist.init_process_group("gloo", store=job, rank=rank, world_size=2)
    return exit_right_after_a_timeout()


def leave_a_group_and_live_on(leaver: int, hosts: int, in_flight: bool) -> dict[str, object]:
    """The leaver destroys a freescale subgroup (its ranks on ``hosts`` pretend hosts) after
    three AllToAlls and lives on, silent in it for longer than ``dead_after_s``; each other rank
    then has a fourth AllToAll of it in flight (``in_flight``: started before the destroy) or
    calls one (the last rank a second after the others: a group aborted by their errors would
    show in its own). Returns the rank's error message from that AllToAll and the seconds it
    took from the moment the departure was sure (the leaver: ``None``)."""
    from freescale_comm.options import HOST_ENV

    rank, n = dist.get_rank(), dist.get_world_size()
    os.environ[HOST_ENV] = f"leave-host-{rank * hosts // n}"
    options = FreescaleOptions(heartbeat_s=0.2, dead_after_s=1.0)
    group = dist.new_group(backend="freescale", timeout=timedelta(seconds=60), pg_options=options)
    del os.environ[HOST_ENV]
    sent = torch.arange(n, dtype=torch.float32) + rank * n
    out = torch.empty(n)
    for _ in range(3):
        dist.all_to_all_single(out, sent, group=group)
    if rank == leaver:
        dist.barrier()
        dist.destroy_process_group(group)
        dist.barrier()  # destroyed
        dist.barrier()  # every other rank has its error
        return {"error": None}
    work = dist.all_to_all_single(out, sent, group=group, async_op=True) if in_flight else None
    dist.barrier()
    dist.barrier()  # the leaver has destroyed the group
    if not in_flight:
        time.sleep(1.5 if rank < n - 1 else 2.5)  # past dead_after_s of its silence
    start = time.monotonic()
    error = _error_of(
        work.wait if work is not None else lambda: dist.all_to_all_single(out, sent, group=group)
    )
    seconds = time.monotonic() - start
    dist.barrier()
    dist.destroy_process_group(group)
    return {"error": error, "seconds": seconds}


def leave_a_group_with_gloo_calls_pending(
    leaver: int, hosts: int, in_flight: bool, via_future: bool = False
) -> dict[str, object]:
    """As ``leave_a_group_and_live_on``, with collectives the group runs on Gloo: every rank
    starts an AllReduce (Gloo's collective #1 of the group) and the leaver waits for it before
    it destroys the group; the others wait for theirs only after the departure is sure, and
    then have a second one in flight (``in_flight``: started before the destroy; waited for
    through its future with ``via_future``, as DDP's backward does) or call one. Returns the
    rank's first sum and its error message from the second AllReduce with the seconds it
    took from the moment the departure was sure (the leaver: the sum alone)."""
    from freescale_comm.options import HOST_ENV

    rank, n = dist.get_rank(), dist.get_world_size()
    os.environ[HOST_ENV] = f"leave-host-{rank * hosts // n}"
    options = FreescaleOptions(heartbeat_s=0.2, dead_after_s=1.0)
    group = dist.new_group(backend="freescale", timeout=timedelta(seconds=60), pg_options=options)
    del os.environ[HOST_ENV]
    first = torch.full((4,), float(rank + 1))
    first_work = dist.all_reduce(first, group=group, async_op=True)
    if rank == leaver:
        first_work.wait()
        dist.barrier()
        dist.destroy_process_group(group)
        dist.barrier()  # destroyed
        dist.barrier()  # every other rank has its error
        return {"sum": first.tolist()}
    second = torch.ones(4)
    work = dist.all_reduce(second, group=group, async_op=True) if in_flight else None
    dist.barrier()
    dist.barrier()  # the leaver has destroyed the group
    time.sleep(0.5)  # its departure is read meanwhile (polls every 0.1 s)
    first_work.wait()  # the leaver ran it: it completes
    start = time.monotonic()
    if work is None:
        error = _error_of(lambda: dist.all_reduce(second, group=group))
    elif via_future:  # Gloo's future, which fails with Gloo's error; the handle names why
        error = f"{_error_of(work.get_future().wait)} [handle: {_error_of(work.wait)}]"
    else:
        error = _error_of(work.wait)
    seconds = time.monotonic() - start
    dist.barrier()
    dist.destroy_process_group(group)
    return {"sum": first.tolist(), "error": error, "seconds": seconds}


def time_out_on_gloo() -> str:
    """Rank 1 calls an AllReduce of a freescale subgroup (group timeout 2 s) that the others
    never call; they call one later. Returns each rank's error as "type: text"."""
    rank = dist.get_rank()
    options = FreescaleOptions(heartbeat_s=0.2, dead_after_s=1.0)
    group = dist.new_group(backend="freescale", timeout=timedelta(seconds=2), pg_options=options)
    dist.barrier(group=group)
    if rank != 1:
        time.sleep(4.5)  # rank 1's AllReduce has timed out
    try:
        dist.all_reduce(torch.ones(4), group=group)
        error = "no error"
    except RuntimeError as err:
        error = f"{type(err).__name__}: {err}"
    dist.barrier()
    dist.destroy_process_group(group)
    return error


def leave_with_a_gloo_call_unwaited_and_exit() -> dict[str, object]:
    """Rank 1 starts an AllReduce on a freescale subgroup (run on its Gloo backend), never
    waits for it, destroys the group and exits at once (``os._exit``); the others call theirs
    only after its destroy began. Its destroy must let that AllReduce finish first (as it
    does the group's own collectives): returns the sum on the others."""
    rank = dist.get_rank()
    options = FreescaleOptions(heartbeat_s=0.2, dead_after_s=1.0)
    group = dist.new_group(backend="freescale", timeout=timedelta(seconds=30), pg_options=options)
    summed = torch.full((4,), float(rank + 1))
    if rank == 1:
        dist.all_reduce(summed, group=group, async_op=True)
        dist.barrier()
        dist.destroy_process_group(group)
        os._exit(0)
    dist.barrier()
    time.sleep(0.5)  # the leaver's destroy has begun
    dist.all_reduce(summed, group=group)
    return {"sum": summed.tolist()}


def store_host_leaves_first() -> dict[str, object]:
    """Rank 0 hosts the job's store; in a freescale group's last AllToAll it has only small
    pieces, while rank 1 sends rank 2 64 MiB. Rank 0 destroys the group and exits as soon as
    its part is done, taking the store with it: rank 1 and 2's AllToAll must still finish, and
    a later one must raise for the departure, not for a death. Returns, per rank, whether its
    output was right and the later call's error."""
    from freescale_comm import FreescaleOptions

    rank, _launcher, _server, job = _job_store_on_rank_0("leaving_store_port", 30)
    dist.init_process_group("gloo", store=job, rank=rank, world_size=3)
    options = FreescaleOptions(heartbeat_s=0.2, dead_after_s=1.0)
    group = dist.new_group(backend="freescale", timeout=timedelta(seconds=30), pg_options=options)
    big = 16 << 20  # float32 elements
    splits = [[1, 1, 1], [1, 1, big], [1, 1, 1]][rank]
    receives = [1, big, 1] if rank == 2 else [1, 1, 1]
    sent = torch.full((sum(splits),), float(rank))
    out = torch.empty(sum(receives))
    dist.all_to_all_single(out[:3], torch.full((3,), float(rank)), group=group)
    dist.all_to_all_single(out, sent, receives, splits, group=group)
    if rank == 0:
        dist.destroy_process_group(group)
        os._exit(0)
    expected = torch.cat([torch.full((k,), float(p)) for p, k in enumerate(receives)])
    right = bool(torch.equal(out, expected))
    time.sleep(1.0)  # rank 0's exit is seen meanwhile
    error = _error_of(lambda: dist.all_to_all_single(out[:3], out[:3], group=group))
    return {"right": right, "error": error}
