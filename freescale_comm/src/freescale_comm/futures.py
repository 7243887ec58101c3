"""The collectives' futures: completed with the collective, their callbacks run off the engine.

A torch future runs its callbacks (``then``, ``add_done_callback``) in the thread that completes
it. A collective completes on the engine thread (or on a thread that drives it), under its lock:
a callback that starts another collective and waits for it (a DDP comm hook built like torch's
quantization or PowerSGD hooks) would wait for the thread that runs it. So a collective's future
is completed there as torch's are, and is done once ``Work.wait`` returns, as Gloo's is; but the
callbacks attached to it in Python run on the group's callback thread (``CallbackRunner``):

- one at a time, in the order they were attached, each once its future is done, so that
  collectives started from callbacks start in one order on every rank where the program
  attaches the callbacks in one order and no other thread starts collectives of the group
  meanwhile (DDP with several buckets does: its hooks start collectives from the autograd
  thread; that interleaving differs between ranks with Gloo as well);
- a callback attached to a done future, from the group's callback thread or while nothing
  attached before it is still waiting or running, runs at once in the attaching thread, as
  torch runs it;
- every group has a thread of its own: a callback waiting for one group holds up no other's.

A callback that waits for the result of a callback attached after it to a future of the same
group that is not done yet waits for its own thread. Callbacks attached by C++ (``collect_all``,
a future handed to C++) run in the completing thread, as torch's do.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


class CollectiveFuture(torch.futures.Future):
    """A collective's future: its Python callbacks run through the group's ``CallbackRunner``."""

    def __init__(self, runner: CallbackRunner) -> None:
        super().__init__()
        self._runner = runner

    def then(self, callback: Callable[[torch.futures.Future], Any]) -> torch.futures.Future:
        child: torch.futures.Future = torch.futures.Future()
        self._runner.attach(_Callback(self, callback, child))
        return child

    def add_done_callback(self, callback: Callable[[torch.futures.Future], None]) -> None:
        self._runner.attach(_Callback(self, callback, None))


@dataclass
class _Callback:
    future: torch.futures.Future
    callback: Callable[[torch.futures.Future], Any]
    child: torch.futures.Future | None  # ``then``'s future; None for ``add_done_callback``

    def run(self) -> None:
        try:
            value = self.callback(self.future)
        except Exception as err:
            if self.child is None:  # torch logs these too, and goes on
                logger.exception("freescale: a future's done callback raised")
            else:
                self.child.set_exception(err)
            return
        if self.child is not None:
            self.child.set_result(value)


class CallbackRunner:
    """One group's callback thread and the callbacks still to run, in order (module docstring).

    Args:
        cuda_device: the CUDA device made current on the thread (the group's), or None.
    """

    def __init__(self, cuda_device: int | None) -> None:
        self._cuda_device = cuda_device
        self._cond = threading.Condition()
        self._queue: deque[_Callback] = deque()
        self._thread: threading.Thread | None = None
        self._running = False  # a callback runs (on the thread, or inline in ``attach``)
        self._closed = False

    def attach(self, entry: _Callback) -> None:
        """Runs ``entry`` at once where that keeps the order, else queues it."""
        if threading.current_thread() is self._thread and entry.future.done():
            entry.run()  # inside the callback that runs now: in order
            return
        with self._cond:
            # Once the group is closed every future of it is done and nothing keeps order.
            idle = self._closed or (not self._queue and not self._running)
            inline = idle and entry.future.done()
            if inline:
                self._running = True  # the thread waits for it: one at a time
            else:
                self._queue.append(entry)
                self._start_locked()
                self._cond.notify()
        if inline:
            self._run_one(entry)

    def future_done(self) -> None:
        """Called once a future of the group is done (from any thread)."""
        with self._cond:
            if self._queue:
                self._cond.notify()

    def close(self, timeout_s: float) -> None:
        """Runs what is left once its futures are done (the group fails what is in flight
        first), then ends the thread; a callback still running after ``timeout_s`` is left."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _start_locked(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(
                target=self._run, name="freescale-comm-callbacks", daemon=True
            )
            self._thread.start()

    def _ready_locked(self) -> bool:
        return bool(self._queue) and self._queue[0].future.done() and not self._running

    def _run_one(self, entry: _Callback) -> None:
        """Runs ``entry``, claimed by setting ``_running``; then lets the next one go."""
        try:
            entry.run()
        finally:
            with self._cond:
                self._running = False
                self._cond.notify()

    def _run(self) -> None:
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)
        while True:
            with self._cond:
                while not self._ready_locked():
                    if self._closed and not self._queue:
                        return
                    self._cond.wait(1.0 if self._closed else None)
                entry = self._queue.popleft()
                self._running = True
            self._run_one(entry)
