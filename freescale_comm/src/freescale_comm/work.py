"""The ``dist.Work`` handed back by every freescale collective."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from freescale_comm.collective import WAIT_SLACK_S, Collective
from freescale_comm.errors import FreescaleError, FreescalePeerError, FreescaleTimeoutError

if TYPE_CHECKING:
    from freescale_comm.group import GroupContext

# How often a wait for a Gloo collective looks whether the group was aborted meanwhile.
_ABORT_CHECK_S = 0.1
# What Gloo's errors of its connections say (its transport's source file, which its I/O
# errors name; its timeout; the pairs it closed after one): errors a peer or an abort can
# explain. Gloo's other errors refuse the call's arguments (a dtype or an op its collective
# does not take), on every rank that made the call, and leave its connections usable.
_GLOO_TRANSPORT_MARKS = ("gloo/transport/", "pair closure", "Connection", "Timed out")


class FreescaleWork(dist.Work):
    """Completion handle of one collective: bounded ``wait``, future, error.

    Every blocking wait is bounded by the group's timeout, also when a C++ caller passes
    ``timedelta(0)`` (which c10d uses to mean "no timeout").

    CPU tensors: ``wait`` returns once the data is in the outputs. A collective its caller
    claimed (``Engine.claim``), or that ``wait`` takes back from the engine thread
    (``Engine.take_back``: an asynchronous one the engine has alone), is progressed by ``wait``
    on the calling thread; any other use of the handle first gives it to the engine thread, so
    that a future or a completion poll never waits on a caller that is not driving.

    CUDA tensors: the collective is ordered after the work queued on the caller's current
    stream at call time, and ``wait`` makes the caller's current stream wait for it on the GPU.
    ``wait`` first blocks the CPU until the collective is sealed (driving it there where it is
    claimed or taken back, and the caller has its device current): on the IPC path once every
    peer's header is in (the GPU orders the rest, ``ipc``); on the other paths once the last
    message has arrived (on the staging rings: until its last H2D copy is queued), because the
    last copies and the event that ends them exist only then (see ``cuda``'s module docstring
    for why a flag written by the CPU is not used). A mismatch of inputs raises there. The
    collective keeps its tensors referenced until its copies are done and the group's next
    call (or its destroy). ``synchronize`` blocks until everything is done, and a future is done
    as soon as it is (a watcher thread waits for the end event of a collective somebody
    waits for; the others are found done by a poll: the group's next call, a poll of the
    handle, the deadline watch each second).
    """

    def __init__(self, op: Collective) -> None:
        super().__init__()
        self._op = op

    def wait(self, timeout: timedelta | None = None) -> bool:
        op = self._op
        if self._completing_here() or self._finished():
            if op.on_cuda and op.final is not None:
                self._wait_on_stream()
            return True
        op.group.refuse_wait_on_engine_thread(lambda: op.label)
        if op.on_cuda:
            return self._wait_stream(timeout)
        return self._wait_done(timeout)

    def _completing_here(self) -> bool:
        """True (or the collective's error) where the calling thread is completing the
        collective's future: a callback that C++ chained to it (``collect_all``) runs there,
        on the engine or a CUDA watcher thread, before the event a wait waits for is set."""
        op = self._op
        if not op.completing_here():
            return False
        if op.error is not None:
            raise op.error
        return True

    def _finished(self) -> bool:
        """True (or the collective's error) once it has finished: a wait then waits for
        nothing, also on the engine thread (a callback chained with ``collect_all`` runs once
        every collective it waits for is done)."""
        op = self._op
        if not op.event.is_set():
            return False
        if op.error is not None:
            raise op.error
        return True

    def _bound(self, timeout: timedelta | None) -> tuple[float, bool]:
        """The wait's limit in seconds, and whether it is the caller's (shorter) one."""
        bound = self._op.timeout_s + WAIT_SLACK_S
        short = timeout is not None and 0 < timeout.total_seconds() < bound
        return (timeout.total_seconds() if short else bound), short

    def _block(self, event: threading.Event, limit: float, short: bool, until: float) -> None:
        op = self._op
        if not event.wait(max(0.0, until - time.monotonic())):
            # A caller's shorter timeout only ends this wait; the collective goes on.
            if short:
                raise FreescaleTimeoutError(f"{op.label}: not finished within the {limit:g} s wait")
            op.fail(f"the engine did not finish it within {limit:g} s", "timeout")
        if op.error is not None:
            raise op.error

    def _wait_done(self, timeout: timedelta | None) -> bool:
        op = self._op
        op.finish_promptly()
        limit, short = self._bound(timeout)
        until = time.monotonic() + limit
        self._take_back()
        op.group.engine.drive(op, until)
        self._block(op.event, limit, short, until)
        return True

    def _wait_stream(self, timeout: timedelta | None) -> bool:
        op = self._op
        limit, short = self._bound(timeout)
        until = time.monotonic() + limit
        # A claimed collective (or an asynchronous one taken back) is driven here until its last
        # copies are queued; the engine thread waits for them (and frees the buffers) while the
        # caller goes on.
        self._take_back()
        op.group.engine.drive(op, until, op.sealed.is_set)
        self._block(op.sealed, limit, short, until)
        self._wait_on_stream()
        return True

    def _take_back(self) -> None:
        """Lets this wait drive an asynchronous collective that the engine thread has alone
        (``Engine.take_back``); a CUDA one only on the thread that launched it, whose current
        device and CUDA context it has (UCX's CUDA transports use the driving thread's)."""
        op = self._op
        if op.on_cuda and (
            op.launched_by != threading.get_ident() or not op.group.drivable_here(op)
        ):
            return
        op.group.engine.take_back(op)

    def _wait_on_stream(self) -> None:
        from freescale_comm.cuda import current_stream  # CPU-only processes never import it

        current_stream(self._op.plan.cuda_index).wait_event(self._op.final)

    def _unclaim(self) -> FreescaleWork:
        self._op.group.engine.hand_over(self._op)
        self._op.poll_final()
        return self

    def _done(self) -> bool:
        # Done once its outcome is set: its future completes then, before the event is set, and
        # a thread woken by the future (or a callback chained in C++) may ask in between.
        return self._op.event.is_set() or self._op.outcome_set()

    def is_completed(self) -> bool:
        return self._unclaim()._done()

    def is_success(self) -> bool:
        return self._unclaim()._done() and self._op.error is None

    def exception(self) -> BaseException | None:
        return self._unclaim()._op.error

    def get_future(self) -> torch.futures.Future:
        return self._unclaim()._op.future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        # Gloo's: a future value that is a flat list of tensors (an AllGather into one
        # tensor's pieces), else the outputs (``Work.result`` is a flat list).
        value = self._op.plan.value
        flat = isinstance(value, list) and all(isinstance(t, torch.Tensor) for t in value)
        return value if flat else self._op.plan.result

    def synchronize(self) -> None:
        if self._completing_here() or self._finished():
            return
        self._op.group.refuse_wait_on_engine_thread(lambda: self._op.label)
        self._wait_done(None)


def aborted_error(
    group: GroupContext,
    what: str,
    failed: BaseException | None = None,
    before_call: bool = False,
) -> FreescalePeerError | None:
    """The error of ``what`` (``send``, ``all_reduce``, ...) that the group runs on Gloo, where
    the group is aborted, or None; ``failed``: Gloo's error of it, which an abort on its way
    may explain where it is a failure of Gloo's connections (``gloo_transport_failed``;
    ``GroupContext.broken_after_gloo_failed``); ``before_call``: the abort came before the
    call, which is refused."""
    if failed is not None and gloo_transport_failed(failed):
        reason = group.broken_after_gloo_failed()
    else:
        reason = group.broken
    if reason is None:
        return None
    when = "earlier " if before_call else ""
    return FreescalePeerError(
        f"{group.who}: {what} on Gloo: the group was aborted {when}by {reason}"
    )


def gloo_transport_failed(err: BaseException) -> bool:
    """Whether Gloo's ``err`` is a failure of its connections (a peer gone, its timeout, the
    group's abort), rather than its refusal of the call's arguments, which it raises alike
    on a Gloo group and leaves the group usable after."""
    text = str(err)
    return any(mark in text for mark in _GLOO_TRANSPORT_MARKS)


def gloo_error(inner: dist.Work) -> BaseException | None:
    """The error of Gloo's completed ``inner`` (None: it succeeded), taken from its ``wait``:
    torch 2.11's ``Work.exception()`` raises a pybind11 ``TypeError`` instead of returning an
    error it holds (a C++ ``exception_ptr`` it cannot convert)."""
    try:
        inner.wait()
    except Exception as err:  # Gloo's error, rethrown
        return err
    return None


class GlooHandle(dist.Work):
    """A handle over Gloo's (``inner``) of ``what`` the group ran there, whose ``wait`` its
    subclasses bound; the rest is Gloo's."""

    def __init__(self, inner: dist.Work, group: GroupContext, what: str) -> None:
        super().__init__()
        self._inner = inner
        self._group = group
        self._what = what
        self._first_wait: float | None = None

    def _aborted(self, failed: BaseException | None = None) -> FreescalePeerError | None:
        return aborted_error(self._group, self._what, failed)

    def _ended_by_abort(self) -> FreescalePeerError:
        """The error of a wait that the group's abort ended."""
        return self._aborted() or FreescalePeerError(
            f"{self._group.who}: {self._what} on Gloo: the group was aborted"
        )

    def _waiting_since(self) -> float:
        """When the first wait on this handle began (``GroupContext.gloo_wait_began``)."""
        if self._first_wait is None:
            self._first_wait = time.monotonic()
        return self._first_wait

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self) -> Any:
        return gloo_error(self._inner) if self._inner.is_completed() else None

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._inner.result()

    def synchronize(self) -> None:
        self.wait()


class DelegatedWork(GlooHandle):
    """The handle of a collective the group ran on its Gloo backend, whose waits also end once
    the group is aborted (a peer found dead or stopped by the liveness thread, ``abort()``) or
    a peer destroyed the group without running this collective (``GroupContext.gloo_call``
    numbers them).

    Gloo's own wait for a peer that stopped, or that died while its neighbours in Gloo's ring
    still wait for one another, lasts until the group's timeout; here it raises a
    ``FreescalePeerError`` naming the abort's reason within ``_ABORT_CHECK_S`` of it; Gloo's
    future (``get_future``; DDP's backward waits on it) fails then too, with Gloo's error,
    since the abort fails Gloo's connections. The collective itself is not cancelled: Gloo has
    no way to; the group is unusable after an abort anyway. Not for Gloo's send and recv,
    whose wait with a limit fails the transfer when the limit runs out.

    It is completed where Gloo's is or once the group is aborted (``exception`` then names
    what ``wait`` raises), so a caller that polls it instead of waiting sees an abort too; while
    such a caller has not seen it completed, the group counts it as waiting on Gloo
    (``GroupContext.gloo_polled``: a store that stopped answering aborts the group then).

    Args:
        inner: Gloo's handle.
        group: the group's context (whose ``broken`` says why it was aborted).
        what: what the collective was (``all_reduce``, ...), for the error.
        number: its number among the group's collectives on Gloo (``GroupContext.gloo_call``).
    """

    def __init__(self, inner: dist.Work, group: GroupContext, what: str, number: int) -> None:
        super().__init__(inner, group, what)
        self.number = number
        self._future_lock = threading.Lock()
        self._future_watched = False
        self._polled = False

    def _aborted(self, failed: BaseException | None = None) -> FreescalePeerError | None:
        """The abort's error, or else that of a peer's departure that leaves this collective
        unfinished for good; None while neither happened. ``failed``: Gloo's error of it,
        whose cause may be on its way (``aborted_error``)."""
        error = super()._aborted() or self._left_behind()
        if error is None and failed is not None:
            error = super()._aborted(failed) or self._left_behind()
        return error

    def _left_behind(self) -> FreescalePeerError | None:
        departed = self._group.gloo_departure_error(self.number)
        if departed is None:
            return None
        return FreescalePeerError(f"{self._group.who}: {self._what} on Gloo: {departed}")

    def _gloo_failure(self, err: BaseException) -> FreescaleError | None:
        """The error of a collective Gloo failed with ``err``: None where Gloo refused its
        arguments (``err`` is the error to raise, as on a Gloo group, which stays usable);
        else the abort's or departure's that caused it (``_aborted``), else Gloo's own (its
        timeout, a peer gone that liveness has not judged yet): Gloo's backend is unusable
        after it, so the group is aborted with that reason, which every peer then raises."""
        if not gloo_transport_failed(err):
            return None
        error = self._aborted(err)
        if error is not None:
            return error
        failure = f"{self._what} on Gloo failed: {err}"
        self._group.abort(f"rank {self._group.rank}: {failure}")
        timed_out = "timed out" in str(err).lower()
        error_type = FreescaleTimeoutError if timed_out else FreescalePeerError
        return error_type(f"{self._group.who}: {failure}")

    def is_completed(self) -> bool:
        if self._inner.is_completed() or self._aborted() is not None:
            return True
        if not self._polled:
            self._polled = True
            self._group.gloo_polled(self._inner, self._waiting_since())
        return False

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self) -> Any:
        """What ``wait`` raises (None: it returns), or None while Gloo's collective runs and
        the group is not aborted. Where Gloo failed it, waits as ``wait`` does for an abort on
        its way, whose error is the one to name."""
        if self._inner.is_completed():
            error = gloo_error(self._inner)
            if error is None:
                return None
            return self._gloo_failure(error) or error
        return self._ended_by_abort() if self._aborted() is not None else None

    def wait(self, timeout: timedelta | None = None) -> bool:
        key = self._group.gloo_wait_began(self._waiting_since())
        try:
            return self._wait(timeout)
        finally:
            self._group.gloo_wait_ended(key)

    def _wait(self, timeout: timedelta | None) -> bool:
        # 0 (c10d's "no timeout") and None leave the bound to Gloo's own timeout.
        limit = None if timeout is None or not timeout else max(timeout.total_seconds(), 0.0)
        until = None if limit is None else time.monotonic() + limit
        while True:
            step = _ABORT_CHECK_S
            if until is not None:
                step = min(step, until - time.monotonic())
                if step <= 0:  # (Gloo would take a wait of 0 for one without a limit)
                    raise FreescaleTimeoutError(
                        f"{self._group.who}: {self._what} on Gloo: not finished within "
                        f"the {limit:g} s wait"
                    )
            try:  # at least 1 ms: a timedelta that rounds to 0 would wait without a limit
                return self._inner.wait(timedelta(seconds=max(step, 1e-3)))
            except RuntimeError as err:
                # Gloo's own error, or the end of a step: a step's end leaves it not completed
                # (but for a collective that completed just after: its wait returns at once).
                if self._inner.is_completed():
                    try:
                        return self._inner.wait()
                    except RuntimeError as failed:
                        # Where an abort failed Gloo's pairs (``point_to_point``), its error
                        # says why; Gloo's would not.
                        error = self._gloo_failure(failed)
                        if error is None:
                            raise
                        raise error from failed
                error = self._aborted()
                if error is not None:
                    raise error from err

    def get_future(self) -> torch.futures.Future:
        """Gloo's own future. It completes, with Gloo's error, once the group is aborted or a
        peer left without running this collective too: their connections are failed then
        (``point_to_point.GlooBreaker``), and this handle's ``wait`` / ``exception`` name
        the cause. Not a Python future chained to Gloo's: a C++ waiter (DDP's reducer) takes
        such a future's value with Python code on its own thread, where a Ctrl-C became a
        ``RuntimeError`` instead of a ``KeyboardInterrupt``."""
        future = self._inner.get_future()
        with self._future_lock:
            if not self._future_watched:
                self._future_watched = True
                # A waiter on the future may never wait on the handle (DDP's reducer).
                key = self._group.gloo_wait_began(self._waiting_since())
                future.add_done_callback(lambda done: self._future_done(done, key))
        return future

    def _future_done(self, future: torch.futures.Future, key: int) -> None:
        """Gloo's future is done (on the thread that completed it): the wait is over, and a
        failure is taken up as ``wait`` takes it up (``_gloo_failure``: an abort on its way
        named, or the group aborted with Gloo's error), on a thread of its own."""
        self._group.gloo_wait_ended(key)
        try:
            future.value()
        except RuntimeError as err:
            threading.Thread(
                target=self._gloo_failure,
                args=(err,),
                name="freescale-comm-gloo-failed",
                daemon=True,  # a process on its way out need not wait for the abort
            ).start()
