"""Point-to-point on Gloo (``send``, ``recv``) whose waits end once the group is aborted.

Gloo's wait for a peer that stopped, hung or lost its host (no closed connection tells Gloo)
lasts until the group's timeout, 30 min by default. Its send / recv handle cannot be waited on in
steps, as ``work.DelegatedWork`` does for collectives: a wait whose limit runs out fails every
transfer of that Gloo context ("Application timeout caused pair closure"), and the handle does
not say it is complete before a wait. That failure is what ends them here: once the group is
aborted, ``GlooBreaker`` waits 1 ms for a receive that never comes in each of the Gloo
backend's contexts (one per network device), and every pending send and recv there raises,
which the handle turns into the abort's ``FreescalePeerError``. Those waits stay Gloo's, in the
caller's thread. A receive from any source is queued outside the connections that this fails:
its wait runs on a thread of its own (``AnySourceReceiveWork``), and the caller waits for that
thread or the abort, whichever comes first.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from freescale_comm.work import GlooHandle

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from freescale_comm.group import GroupContext

# The tags of the receives that break the Gloo backend's contexts (Gloo picks a send's or a
# receive's context by its tag modulo their count): ones no caller's send carries.
_BREAK_TAG = 2**31 - 1
_BREAK_WAIT = timedelta(milliseconds=1)
# How long an abort waits for the breaker: with Gloo's lazy connections
# (``TORCH_GLOO_LAZY_INIT``), a receive from a stopped peer never connected to waits for its
# connection until Gloo's timeout, on the breaker's thread alone.
_BREAK_JOIN_S = 0.5

# The breakers running now. A thread still inside Gloo's wait when the interpreter finalizes is
# ended as it takes the GIL back (``pthread_exit``), through the noexcept destructor of
# pybind11's GIL guard: ``std::terminate``, so a process that exits right after the abort's
# error died of SIGABRT (a survivor in 20 of 21 runs of 3 ranks) instead of exiting with its
# status. At exit the breakers start no further probe and are waited for (``_settle_breakers``).
_breakers: set[threading.Thread] = set()
_breakers_lock = threading.Lock()
_exiting = False


def _settle_breakers() -> None:
    global _exiting
    with _breakers_lock:
        _exiting = True
        running = list(_breakers)
    deadline = time.monotonic() + _BREAK_JOIN_S
    for breaker in running:
        breaker.join(max(0.0, deadline - time.monotonic()))


atexit.register(_settle_breakers)


class GlooBreaker:
    """Fails every pending send, recv and collective of a group's Gloo backend once the group
    is aborted, or once a peer left it without running a collective in flight there: it is
    unusable after either anyway, and a wait on Gloo's handle or future ends no other way.

    Args:
        plain: the group's plain twin, whose CPU send / recv run on its Gloo backend.
        contexts: how many contexts that Gloo backend has (one per network device).
        group: the group's context (its abort).
    """

    def __init__(self, plain: dist.ProcessGroup, contexts: int, group: GroupContext) -> None:
        self._plain = plain
        self._contexts = contexts
        self._group = group
        self._forget_abort = group.on_abort(self._break_soon)
        self._forget_departure = group.on_departure(self._break_if_doomed)

    def close(self) -> None:
        """Forgets the abort and departure hooks, which refer back to the group."""
        self._forget_abort()
        self._forget_departure()

    def _break_if_doomed(self) -> None:
        """A departure read: where a collective on Gloo in flight can never complete, fails
        Gloo's connections as an abort does, so that Gloo's future of it (DDP's) fails, where
        it would wait until Gloo's timeout. The group runs no later one (``gloo_call``)."""
        doomed = self._group.gloo_doomed()
        if doomed is not None:
            logger.error("freescale: %s: %s", self._group.who, doomed)
            self._break_soon()

    def _break_soon(self) -> None:
        """Breaks on a thread of its own, waited for at most ``_BREAK_JOIN_S``: the abort's
        later hooks and the liveness thread must not wait for a connection."""
        breaker = threading.Thread(target=self._break, name="freescale-comm-break", daemon=True)
        with _breakers_lock:  # held until started: ``_settle_breakers`` joins only those
            if _exiting:
                return
            _breakers.add(breaker)
            breaker.start()
        breaker.join(_BREAK_JOIN_S)

    def _break(self) -> None:
        rank, size = self._plain.rank(), self._plain.size()
        try:
            for context in range(self._contexts):
                # A receive from a peer whose connection is closed (one that failed its own
                # pairs first) fails at once, without the timeout that fails the others: each
                # peer in turn. Once one timed out, every later receive of that context fails
                # at once.
                for step in range(1, size):
                    if _exiting:
                        return
                    self._probe(context, (rank + step) % size)
        finally:
            with _breakers_lock:
                _breakers.discard(threading.current_thread())

    def _probe(self, context: int, peer: int) -> None:
        with contextlib.suppress(RuntimeError):
            probe = self._plain.recv([torch.empty(1)], peer, _BREAK_TAG - context)
            probe.wait(_BREAK_WAIT)


class PointToPointWork(GlooHandle):
    """The handle of a ``send`` / ``recv`` the group ran on Gloo: ``wait`` returns or raises
    what Gloo's does, with the same ``timeout``, but raises a ``FreescalePeerError`` naming the
    abort's reason once the group is aborted (a peer found stopped or dead by the liveness
    thread, ``abort()``).

    Args:
        inner: Gloo's handle.
        group: the group's context (why it was aborted).
        what: what the call was (``send``, ``recv``), for the error.
    """

    def wait(self, timeout: timedelta | None = None) -> bool:
        key = self._group.gloo_wait_began(self._waiting_since())
        try:
            return self._inner.wait() if timeout is None else self._inner.wait(timeout)
        except RuntimeError as err:
            error = self._aborted(err)
            if error is None:
                raise
            raise error from err
        finally:
            self._group.gloo_wait_ended(key)

    def source_rank(self) -> int:
        return self._inner.source_rank()

    def _source_rank(self) -> int:
        return self._inner._source_rank()


class AnySourceReceiveWork(PointToPointWork):
    """The handle of a receive from any source the group ran on Gloo, which no failure of
    Gloo's connections ends: its first ``wait`` waits for Gloo's on a thread of its own
    (started then; left waiting until Gloo's timeout where the group is aborted first)."""

    def __init__(self, inner: dist.Work, group: GroupContext, what: str) -> None:
        super().__init__(inner, group, what)
        self._ended = threading.Event()
        self._outcome: tuple[bool, Any] | None = None  # (returned, its value or its error)
        self._start_lock = threading.Lock()
        self._waiter: threading.Thread | None = None

    def _wait_on_gloo(self, timeout: timedelta | None) -> None:
        try:
            self._outcome = (True, super().wait(timeout))
        except BaseException as err:  # raised in the caller's thread
            self._outcome = (False, err)
        self._ended.set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        with self._start_lock:
            if self._waiter is None:
                self._waiter = threading.Thread(
                    target=self._wait_on_gloo,
                    args=(timeout,),
                    name="freescale-comm-recv-any",
                    daemon=True,
                )
                self._waiter.start()
        forget = self._group.on_abort(self._ended.set)
        self._ended.wait()
        forget()
        if self._outcome is None:  # ended by the abort
            raise self._ended_by_abort()
        returned, value = self._outcome
        if not returned:
            raise value
        return value

    def is_completed(self) -> bool:
        return self._outcome is not None and self._outcome[0]
