"""The process's progress thread: drives UCX and collectives, bounds them.

One daemon thread per process, for every group. While collectives are in flight it progresses
the UCX worker and the rings (for those with messages there: ``Op.uses_transport``), notices
completed requests (ucxx has no blocking wait from Python), posts the next step of multi-step
algorithms (the ring), completes collectives (their futures' callbacks run on another thread,
``futures``), and fails collectives that run past their deadline or whose peer died; when
nothing moved it sleeps in an epoll over the worker's events (GIL released) until UCX signals an
event, something calls ``Transport.wake`` (a new collective, a finished CUDA copy) or
``_EPOLL_MS`` passes — so an arriving message wakes it at once and an idle wait costs no CPU.
Before it sleeps it polls for a while, yielding its core between polls (``idle_poll_s``: a
peer's message that comes within that window is seen without a wake-up), unless the process's
helper or reader threads have work (``local_copies.helpers_busy``): they need the GIL, which a
polling thread takes back before they get it, so it sleeps at once. Where ranks outnumber
cores it also sleeps once its yields keep finding no other thread ready on its core
(``yield_core``). While no collective is in flight it sleeps on a condition, and progresses the
worker once at each wake (``_IDLE_WAKE_S`` apart at most): a peer's endpoint close may wait for
this worker's acknowledgement. In flight or not, it runs each group's periodic watches when due
(the deadlines of collectives left to their CUDA end event, ``group``). A collective's
health check only reads what the group's liveness thread last found (``liveness``): no store
request is made here.

A synchronous collective (``async_op=False``: the caller waits at once) that finds the engine
idle is *claimed* by its caller instead: ``Work.wait`` runs the same loop on the calling thread
(``drive``; a CUDA one until its last copies are queued, the engine then waits for them), so
the thread that sleeps in the epoll is the one that returns the result. That
saves two thread hand-offs per collective (caller to engine, engine back to caller), each a
scheduler wake-up that costs tens of microseconds on an idle machine and up to a time slice on a
loaded one. A claimed collective that its caller does not drive within ``_CLAIM_GRACE_S``, or
that outlives a shorter ``wait(timeout)``, is taken over by the engine thread. An asynchronous
collective that did not run to its end in its call (``Collective.start``) goes to the engine
thread, and its caller's ``wait`` *takes it back* (``take_back``) where the engine thread has it
alone and is between two steps (a CUDA one: on the thread that launched it): the
caller then drives it as if it had claimed it, instead of sleeping until the engine thread
wakes it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from freescale_comm.local_copies import helpers_busy

if TYPE_CHECKING:
    from freescale_comm.transport import Transport

logger = logging.getLogger(__name__)

ENGINE_THREAD = "freescale-comm-engine"  # the name of the process's progress thread
# Bound of one epoll sleep while collectives are in flight. Most completions wake the sleeper (UCX
# events; CUDA copies through ``cuda.StreamWatcher``); this bounds the cost of a wake-up lost in a
# race, or of a CUDA end event nobody hands to a watcher (an unawaited collective the engine
# drives finds it by its query), and sets how often deadlines are checked between events.
_EPOLL_MS = 1
# How often collectives in flight are checked against their group's liveness verdict (no store
# request: the verdict is what the liveness thread's last poll found).
_HEALTH_PERIOD_S = 0.05
# A claimed collective nobody drives for this long goes to the engine thread (a safety net: the
# claim is made only for calls whose caller waits at once, or by a wait that takes it back).
_CLAIM_GRACE_S = 0.05
# The longest sleep of an idle engine: each wake progresses the worker once (``_run``).
_IDLE_WAKE_S = 0.25
# How long a thread that yields its core when idle (``idle_wait="yield"``, and ``auto`` where
# ranks outnumber cores) keeps polling without progress before it sleeps in the epoll: long
# enough for the peers of a collective in flight to answer (and to take their turn where ranks
# outnumber cores), short enough that a rank waiting for a straggler that is still computing
# stops taking a core from it.
YIELD_S = 0.002
# The same under ``auto`` where every rank has a core: about what a wake-up from the epoll costs
# (a peer's wake-up byte, the epoll's return and a scheduler wake-up, tens of microseconds on an
# idle VM), so that a peer a little behind in a run of collectives is seen without one, while a
# rank that waits for a peer still computing takes the GIL and a core for no longer than that.
POLL_S = 100e-6


# A yield that returns within this long gave the core to nobody: no other thread was ready on it.
_ALONE_YIELD_S = 5e-6
# Where a group's ranks outnumber the cores, a thread whose yields give its core to nobody this
# many times in a row sleeps instead of polling on (``yield_core``): polling alone on a core, it
# keeps the scheduler from moving a rank that waits for a core onto it (an idle core pulls a
# waiting thread over; a busy one does not). With 4 ranks on 2 cores one rank was seen polling
# through whole AllToAlls of 1-16 MiB, its CPU time per call near the call's, which then
# took 1.3-1.5x as long (``benchmarks/results/comm_cpu/alone_yields/``).
ALONE_YIELDS = 16
_yields = threading.local()


def alone_yields(host_ranks: int, cores: int) -> int:
    """The ``yield_core`` limit of a group's waiting threads: ``ALONE_YIELDS`` where its
    ``host_ranks`` on this host outnumber the ``cores`` this process may use, else 0 (none: a
    rank with a core of its own polls alone on it by design)."""
    return ALONE_YIELDS if host_ranks > cores else 0


def yield_core(alone_limit: int) -> bool:
    """Yields the calling thread's core (``os.sched_yield``); with ``alone_limit``, False once
    that many of this thread's yields in a row returned at once (no other thread was ready on
    its core): the caller should sleep instead of polling on."""
    if not alone_limit:
        os.sched_yield()
        return True
    start = time.perf_counter()
    os.sched_yield()
    if time.perf_counter() - start > _ALONE_YIELD_S:
        _yields.alone = 0
        return True
    alone = getattr(_yields, "alone", 0) + 1
    _yields.alone = 0 if alone >= alone_limit else alone
    return alone < alone_limit


def idle_poll_s(idle_wait: str, host_ranks: int, cores: int) -> float:
    """How long a group's waiting threads poll, yielding their core between polls, before they
    sleep in the epoll (``FreescaleOptions.idle_wait``): ``sleep`` not at all, ``yield`` up to
    ``YIELD_S``, ``auto`` up to ``YIELD_S`` where the group's ``host_ranks`` on this host
    outnumber the ``cores`` this process may run on, else up to ``POLL_S``."""
    if idle_wait == "sleep":
        return 0.0
    if idle_wait == "yield" or host_ranks > cores:
        return YIELD_S
    return POLL_S


class Op(Protocol):
    """What the engine needs from a collective in flight."""

    group: GroupHealth
    seq: int  # its number in the group
    started: float  # time.monotonic() at its call
    deadline: float
    finished: bool
    needs_engine: bool  # False: only its CUDA end event is left (``Collective.poll_final``)
    queued_behind: bool  # nothing moves it before an earlier op does: skipped by a pass
    uses_transport: bool  # a step progresses the transport for it (else it reads counters)
    idle_poll_s: float  # how long a wait polls before it sleeps (``idle_poll_s``)
    alone_yields: int  # ... or after how many yields that found no other thread (``yield_core``)

    def advance(self) -> bool:
        """Polls requests and posts what became possible; True if anything progressed."""
        ...

    def expire(self) -> None:
        """Fails the op because its deadline passed."""
        ...

    def fail(self, reason: str, kind: str) -> None:
        """Fails the op (and cancels its requests); ``kind`` picks the exception type."""
        ...


class GroupHealth(Protocol):
    """A group's liveness checks: each returns why a collective cannot finish, or None."""

    def health_error(self, waited_s: float) -> str | None: ...

    def departure_error(self, seq: int) -> str | None: ...


class Watch(Protocol):
    """A group's periodic duty on the engine thread, when due; it must never block."""

    @property
    def next_due(self) -> float:
        """``time.monotonic()`` of its next tick."""
        ...

    def tick(self, now: float) -> None:
        """Does what is due; never raises."""
        ...


class Engine:
    """The process-wide completion thread (see the module docstring)."""

    _instance: Engine | None = None
    _users = 0
    _lock = threading.Lock()

    def __init__(self, transport: Transport, cuda_device: int | None) -> None:
        self._transport = transport
        self._cuda_device = cuda_device
        self._cond = threading.Condition()
        self._ops: list[Op] = []
        self._claimed: Op | None = None
        self._claimed_at = 0.0
        self._driver: int | None = None  # the thread that drives the claimed op, if one does
        # The engine thread is stepping its ops (from taking them to dropping the finished
        # ones): no caller may take one back meanwhile.
        self._stepping = False
        self._watches: list[Watch] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD, daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, transport: Transport, cuda_device: int | None = None) -> Engine:
        """Returns the process's engine, starting its thread if needed.

        ``cuda_device`` is made current on the thread: UCX's CUDA transports need the device's
        context on the thread that progresses them.
        """
        with cls._lock:
            if cls._instance is None:
                cls._instance = Engine(transport, cuda_device)
            cls._users += 1
            return cls._instance

    def release(self) -> None:
        """Gives back one ``acquire``; the last one stops and joins the thread."""
        with Engine._lock:
            Engine._users -= 1
            if Engine._users > 0:
                return
            Engine._instance = None
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def is_engine_thread(self) -> bool:
        """Whether the caller is the engine thread, which alone progresses collectives (and
        runs the callbacks that ``torch.futures.collect_all`` chains in C++)."""
        return threading.current_thread() is self._thread

    def submit(self, op: Op) -> None:
        """Hands an op whose first requests are posted to the thread that completes it."""
        with self._cond:
            self._ops.append(op)
            self._cond.notify()
        # The thread may be asleep in the epoll (other ops in flight): let it see this one now.
        self._transport.wake()

    def claim(self, op: Op) -> bool:
        """Lets the caller drive ``op`` itself (``drive``) if the engine has nothing in flight.

        Two threads sleeping in the same worker's epoll can steal each other's wake-up, so a
        claim is granted only while the engine thread is idle and no other op is claimed.
        Returns False when the op must be ``submit``-ted instead.
        """
        with self._cond:
            if self._ops or self._claimed is not None or self._stopping:
                return False
            self._claimed, self._claimed_at, self._driver = op, time.monotonic(), None
            return True

    def take_back(self, op: Op) -> bool:
        """Claims ``op`` for a caller about to wait for it, as ``claim`` would have at its call,
        where the engine thread has it alone in flight and is not stepping it now; the engine
        thread, which may sleep in the epoll for it, is woken to go back to its condition.
        Returns False where ``op`` stays with the engine thread (or is claimed already)."""
        with self._cond:
            if (
                self._stepping
                or len(self._ops) != 1
                or self._ops[0] is not op
                or self._claimed is not None
                or self._stopping
            ):
                return False
            self._ops = []
            self._claimed, self._claimed_at, self._driver = op, time.monotonic(), None
        self._transport.wake()
        return True

    def drive(self, op: Op, until: float, enough: Callable[[], bool] | None = None) -> None:
        """Progresses a claimed ``op`` on the calling thread until it finishes or ``until``.

        Returns at once if ``op`` is not (or no longer) claimed, or another thread drives it
        (two threads waiting for one asynchronous collective); an op still unfinished at
        ``until``, or once ``enough()`` holds, is handed to the engine thread.
        """
        with self._cond:
            if self._claimed is not op or self._driver is not None:
                return
            self._driver = threading.get_ident()

        def done() -> bool:
            return op.finished or (enough is not None and enough())

        idle_since = time.monotonic()
        next_health = idle_since + _HEALTH_PERIOD_S
        try:
            while not done():
                progressed = self._step([op])
                now = time.monotonic()
                if done() or now >= until:
                    break
                if now >= next_health:
                    next_health = now + _HEALTH_PERIOD_S
                    self._check_health([op])
                if progressed:
                    idle_since = now
                else:
                    self._idle([op], now - idle_since)
        finally:
            self.hand_over(op)

    def hand_over(self, op: Op) -> None:
        """Ends a claim on ``op`` (no-op if it holds none, or if another thread drives it: a
        poll of the handle beside a ``wait``); the engine finishes what is left."""
        with self._cond:
            if self._claimed is not op:
                return
            if self._driver not in (None, threading.get_ident()):
                return
            self._claimed, self._driver = None, None
            if op.finished or not op.needs_engine:
                return
            self._ops.append(op)
            self._cond.notify()
        self._transport.wake()

    def watch(self, watch: Watch) -> None:
        """Keeps ``watch`` ticking on the engine thread until ``unwatch``."""
        with self._cond:
            self._watches.append(watch)
            self._cond.notify()

    def unwatch(self, watch: Watch) -> None:
        with self._cond:
            if watch in self._watches:
                self._watches.remove(watch)

    def _tick(self, now: float) -> None:
        for watch in list(self._watches):
            if now >= watch.next_due:
                watch.tick(now)

    def _step(self, ops: list[Op]) -> bool:
        """One progress call (where an op moves messages) and one advance of each op; True if
        anything progressed."""
        if any(op.uses_transport for op in ops):
            self._transport.progress()
        progressed = False
        for op in ops:
            try:
                if not op.queued_behind:
                    progressed |= op.advance()
                if not op.finished and time.monotonic() > op.deadline:
                    op.expire()
            except Exception as err:  # never let one op kill the thread of all groups
                logger.exception("freescale: internal error in %s", getattr(op, "label", op))
                # "raised": the group is aborted, so the peers waiting for it raise at once.
                op.fail(f"internal error: {type(err).__name__}: {err}", "raised")
        return progressed

    def _idle(self, ops: list[Op], idle_s: float) -> None:
        """Waits after a step that moved nothing, for ``idle_s`` so far: yields the core while
        that is shorter than an op's group polls for (``idle_poll_s``) and the yields find
        other threads on the core (``yield_core``), else sleeps in the epoll; sleeps at once
        while helper threads have work (``local_copies.helpers_busy``: they wake it as each
        job ends)."""
        if (
            not helpers_busy()
            and any(idle_s < op.idle_poll_s for op in ops)
            and yield_core(max(op.alone_yields for op in ops))
        ):
            return
        self._transport.wait_event(_EPOLL_MS)

    def _idle_wait(self) -> None:
        """Sleeps on the condition (lock held) until an op, a liveness tick, a stop, an
        undriven claim or ``_IDLE_WAKE_S``."""
        if self._ops or self._stopping:
            return
        now = time.monotonic()
        wake = min([now + _IDLE_WAKE_S, *(w.next_due for w in self._watches)])
        if self._claimed is not None and self._driver is None:
            if now >= self._claimed_at + _CLAIM_GRACE_S:
                self._ops.append(self._claimed)
                self._claimed = None
                return
            wake = min(wake, self._claimed_at + _CLAIM_GRACE_S)
        if wake > now:
            self._cond.wait(wake - now)

    def _run(self) -> None:
        if self._cuda_device is not None:
            import torch

            from freescale_comm.cuda import driver

            torch.cuda.set_device(self._cuda_device)
            # UCX's CUDA transports and our driver calls need the context current on this
            # thread, which set_device alone does not guarantee (see ``cuda.driver().bind``).
            try:
                driver().bind(self._cuda_device)
            except Exception:  # the thread must live on; CUDA collectives will report it
                logger.exception("freescale: no CUDA context on the engine thread")
        next_health = idle_since = 0.0
        waited_for: list[Op] = []
        while True:
            with self._cond:
                self._idle_wait()
                if self._stopping and not self._ops:
                    return
                ops = list(self._ops)
                self._stepping = bool(ops)
                undriven = self._claimed is None
            now = time.monotonic()
            self._tick(now)
            if not ops:
                waited_for = []  # an op that comes back (a wait took it back) starts a new wait
                if undriven:
                    # A peer's endpoint close (or a send of a finished collective) may wait
                    # for this worker's acknowledgement, which it sends only when progressed.
                    self._transport.progress()
                continue
            if ops != waited_for:  # a new op: a wait that starts now
                waited_for, idle_since = ops, now
            progressed = self._step(ops)
            if now >= next_health:
                next_health = now + _HEALTH_PERIOD_S
                self._check_health([op for op in ops if not op.finished])
            with self._cond:
                self._ops = [op for op in self._ops if not op.finished]
                self._stepping = False
            if progressed:
                idle_since = now
            else:
                self._idle(ops, time.monotonic() - idle_since)

    def _check_health(self, ops: list[Op]) -> None:
        now = time.monotonic()
        for op in ops:
            error = op.group.health_error(now - op.started)
            if error is not None:
                op.fail(error, "peer")
                continue
            departed = op.group.departure_error(op.seq)
            if departed is not None:
                op.fail(departed, "departed")
