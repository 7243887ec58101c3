"""The collectives' futures, completed on a thread of their own in the order they were asked for.

A future's callbacks (``then``, ``add_done_callback``) run in the thread that completes it. That
must not be the engine thread: a callback that starts another collective and waits for it (a
DDP comm hook built like torch's quantization or PowerSGD hooks) would wait for the thread that
runs it. One settling thread per process completes them instead, in the order they were asked
for (``Work.get_future``), which on every rank is the program's order: callbacks that start
collectives start them in the same order everywhere, as a group's collectives must be started.

A callback that waits for a future behind it in that order (one it asked for itself, or a
later one) completes that future at once, in the same thread, once its collective is done.
Waiting from a callback on anything else that needs a later future (``collect_all`` over it, a
``then`` of it) waits for its own thread: such a callback must wait for the future itself. The
order spans the process's groups: a future waits for those of any group asked for before it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from freescale_comm.errors import FreescaleError

logger = logging.getLogger(__name__)
Outcome = tuple[bool, Any]  # (True, value) or (False, exception)


class CollectiveFuture(torch.futures.Future):
    """A collective's future (see the module docstring).

    Args:
        wait_done: blocks until the collective is done, bounded by its group's timeout; raises
            its error.
    """

    def __init__(self, wait_done: Callable[[], None]) -> None:
        super().__init__()
        self._wait_done: Callable[[], None] | None = wait_done
        self._outcome: Outcome | None = None
        self._taken = False  # completed, or being completed, by one thread

    def wait(self) -> Any:
        wait_done = self._wait_done
        if wait_done is not None and _SETTLER.is_settling_thread():
            with contextlib.suppress(FreescaleError):  # the future carries the same error
                wait_done()
            _SETTLER.settle_now(self)
        return super().wait()


def _complete(future: CollectiveFuture, outcome: Outcome) -> None:
    future._wait_done = None  # it refers to the collective, which refers to this future
    ok, value = outcome
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


class _Settler:
    """The process's settling thread and the futures it has still to complete, in order."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[CollectiveFuture] = deque()
        self._thread: threading.Thread | None = None

    def is_settling_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def expect(self, future: CollectiveFuture) -> None:
        """Queues a future asked for before its collective finished."""
        with self._cond:
            self._queue.append(future)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="freescale-comm-futures", daemon=True
                )
                self._thread.start()

    def resolve(self, future: CollectiveFuture, outcome: Outcome) -> None:
        """Records a queued future's outcome; the settling thread completes it in its turn."""
        with self._cond:
            future._outcome = outcome
            self._cond.notify()

    def settle_now(self, future: CollectiveFuture) -> None:
        """Completes ``future`` in the calling thread, unless it is done or being done."""
        with self._cond:
            if future._taken or future._outcome is None:
                return
            future._taken = True
        _complete(future, future._outcome)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue or (
                    self._queue[0]._outcome is None and not self._queue[0]._taken
                ):
                    self._cond.wait()
                future = self._queue.popleft()
                if future._taken:
                    continue
                future._taken = True
            try:
                _complete(future, future._outcome)
            except Exception:  # torch keeps callbacks' errors; this thread serves every future
                logger.exception("freescale: completing a collective's future raised")

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's thread and queue are not this process's."""
        self._cond = threading.Condition()
        self._queue = deque()
        self._thread = None


_SETTLER = _Settler()
os.register_at_fork(after_in_child=_SETTLER.forget_after_fork)


def make_future(outcome: Outcome | None, wait_done: Callable[[], None]) -> CollectiveFuture:
    """A collective's future: completed now if ``outcome`` is known, else queued (``resolve``)."""
    future = CollectiveFuture(wait_done)
    if outcome is None:
        _SETTLER.expect(future)
    else:
        future._taken = True
        _complete(future, outcome)
    return future


def resolve(future: CollectiveFuture, outcome: Outcome) -> None:
    """Hands a queued future its collective's outcome (from any thread; no callback runs)."""
    _SETTLER.resolve(future, outcome)
