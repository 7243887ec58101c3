"""The collectives' futures: completed with the collective, their callbacks run off the engine.

A torch future runs its callbacks (``then``, ``add_done_callback``) in the thread that completes
it. A collective completes on the engine thread (or on a thread that drives it), under its lock:
a callback that starts another collective and waits for it (a DDP comm hook built like torch's
quantization or PowerSGD hooks) would wait for the thread that runs it. So a collective's future
is completed there as torch's are, and is done once ``Work.wait`` returns, as Gloo's is; but the
callbacks attached to it in Python run through the group's ``CallbackRunner``:

- one at a time, in the order they were attached, each once its future is done, so that
  collectives started from callbacks start in one order on every rank where the program
  attaches the callbacks in one order and no other thread starts collectives of the group
  meanwhile (DDP with several buckets does: its hooks start collectives from the autograd
  thread; that interleaving differs between ranks with Gloo as well);
- on the group's callback thread; or at once in the attaching thread, as torch runs it, when
  the future is done and no callback attached before it is waiting or running; a callback
  attached from inside a running callback runs in its thread as soon as its future is done
  (``then`` waits for that);
- every group has a thread of its own: a callback waiting for one group holds up no other's.

Each runs as a callback of a private torch future that the runner completes when its turn
comes, so errors reach ``then``'s future as torch's own ``then`` reports them. Callbacks that
C++ attaches (``torch.futures.collect_all`` over these futures, and callbacks on its result)
run in the completing thread, as torch's do: on the engine thread, where ``Work.wait`` for a
collective not yet finished (and so a synchronous collective) raises at once and aborts the
group (``GroupContext.refuse_wait_on_engine_thread``); a future's ``wait`` there, which C++
serves, still hangs until the group timeout.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class CollectiveFuture(torch.futures.Future):
    """A collective's future: its Python callbacks run through the group's ``CallbackRunner``."""

    def __init__(self, runner: CallbackRunner) -> None:
        super().__init__()
        self._runner = runner

    def then(self, callback: Callable[[torch.futures.Future], Any]) -> torch.futures.Future:
        trigger: torch.futures.Future = torch.futures.Future()
        child = trigger.then(lambda _: callback(self))
        self._runner.attach(_Turn(self, trigger))
        return child

    def add_done_callback(self, callback: Callable[[torch.futures.Future], None]) -> None:
        trigger: torch.futures.Future = torch.futures.Future()
        trigger.add_done_callback(lambda _: callback(self))
        self._runner.attach(_Turn(self, trigger))

    def complete(self, ok: bool, value: Any) -> None:
        """Sets the collective's outputs (``ok``) or its error, and lets the callbacks that
        wait for it run (no Python callback runs in this thread)."""
        if ok:
            self.set_result(value)
        else:
            self.set_exception(value)
        self._runner.future_done()


@dataclass
class _Turn:
    """One attached callback: completing ``trigger`` runs it (in the completing thread)."""

    future: torch.futures.Future
    trigger: torch.futures.Future

    def run(self) -> None:
        self.trigger.set_result(None)


class CallbackRunner:
    """One group's callback thread and the callbacks still to run, in order (module docstring).

    Args:
        cuda_device: the CUDA device made current on the thread (the group's), or None.
    """

    def __init__(self, cuda_device: int | None) -> None:
        self._cuda_device = cuda_device
        self._cond = threading.Condition()
        self._queue: deque[_Turn] = deque()
        self._thread: threading.Thread | None = None
        self._running: int | None = None  # the thread running a callback (its ident), if any
        self._closed = False

    def attach(self, turn: _Turn) -> None:
        """Runs ``turn`` at once where that keeps the order, else queues it."""
        me = threading.get_ident()
        if self._running == me:  # attached inside the running callback: its turn is now
            with contextlib.suppress(Exception):  # the callback sees the future's error
                turn.future.wait()
            turn.run()
            return
        with self._cond:
            inline = not self._queue and self._running is None and turn.future.done()
            if inline:
                self._running = me  # the thread waits for it: one at a time
            else:
                self._queue.append(turn)
                self._start_locked()
                self._cond.notify()
        if inline:
            self._run_one(turn)

    def running_here(self) -> bool:
        """Whether the calling thread is running one of the group's callbacks (inline, or on
        the callback thread)."""
        return self._running == threading.get_ident()

    def future_done(self) -> None:
        """Called once a future of the group is done (from any thread)."""
        with self._cond:
            if self._queue:
                self._cond.notify()

    def close(self, timeout_s: float) -> bool:
        """Runs what is left once its futures are done (the group fails what is in flight
        first), then ends the thread; a callback still running after ``timeout_s`` is left.
        Returns whether the thread has ended (or is the calling one)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    def _start_locked(self) -> None:
        # Also after one ended: closed and drained, or killed by a callback's BaseException.
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._run, name="freescale-comm-callbacks", daemon=True
            )
            self._thread.start()

    def _ready_locked(self) -> bool:
        return bool(self._queue) and self._queue[0].future.done() and self._running is None

    def _run_one(self, turn: _Turn) -> None:
        """Runs ``turn``, claimed by setting ``_running``; then lets the next one go."""
        try:
            turn.run()
        finally:
            with self._cond:
                self._running = None
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
                turn = self._queue.popleft()
                self._running = threading.get_ident()
            self._run_one(turn)
