"""CUDA collectives through the host path, the caller's stream gated on the GPU.

``cuda_path="host"``.

For a small collective on a GPU that two processes share without MPS, the copy-engine paths pay
the two contexts' time slices several times over; moving the bytes through page-locked host
memory and the group's CPU path (outboxes, rings, reads of the peer's memory, UCX between hosts)
pays them about twice (``benchmarks/results/comm_gpu/value_gate_probe/``). A call queues on the
caller's current stream, with no kernel and no host function, and returns:

1. D2H copies of the input into a page-locked twin and (under ``validate``) of the output into
   the output's twin, then a write of this call's ``ready`` flag;
2. the gate: ``cuStreamWaitValue64`` on this call's slot of a page-locked flag page;
3. the H2D copy of the output's twin into the output, then a write of its ``done`` flag.

A thread of the route's own takes the calls in order: it polls a call's ``ready`` flag, starts
the collective of the twins on the group's CPU path and waits for it as a synchronous caller
does (so that a small validated one runs to its end on that thread, the express path); when it
ends, succeeded or failed, the CPU writes the gate's slot and the stream goes on.

What stays true on this route:
- Validation: the CPU path checks the plans on every rank before it writes the output's twin,
  so a mismatch leaves the twin holding the output's own bytes, and the H2D writes them back
  unchanged. The route cannot raise at the call what only the peers' headers show, so a failed
  validation aborts the group on every rank, with the mismatch as the reason: the call's work
  raises it (``wait`` if known by then, ``synchronize``), and so does the group's next call.
  An error in this rank's own arguments raises at the call as well.
- Order: collectives start in call order on every rank. The thread starts the routed ones in
  the order they were called, and any other collective of the group first waits until those
  called before it have started (``drain``).
- Faults: a dead peer, the timeout, an abort or the group's destruction opens every gate, so
  that no stream waits forever; the work raises the error.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from freescale_comm.errors import (
    FreescaleError,
    FreescalePeerError,
    FreescaleTimeoutError,
    FreescaleValidationError,
)
from freescale_comm.stream_ops import StreamOps
from freescale_comm.work import FreescaleWork

if TYPE_CHECKING:
    from freescale_comm.algorithms import Plan
    from freescale_comm.collective import Collective
    from freescale_comm.group import GroupContext

# Calls in flight per group: a call whose slot an unfinished call still holds waits for it.
SLOTS = 1024
# Written into every gate on an abort: passes every wait queued before or after.
_OPEN = 1 << 62
# Flag pages and twins of closed groups whose last calls were not seen done: a stream may
# still use them (never freed).
_RETIRED: list[object] = []
# How the route's thread waits for a call's D2H: polls with yields for this long (a small
# collective's copy behind little work), then sleeps this long between polls.
_SPIN_S = 0.0005
_NAP_S = 0.0005
# Twins: page-locked buffers by size class (a power of two, at least this many bytes), at
# most this many per class; a call that finds them all in use waits for the oldest.
_MIN_TWIN_BYTES = 4096
_TWINS_PER_CLASS = 8
# How long ``close`` waits for the last call's H2D before it keeps the memory forever.
_CLOSE_WAIT_S = 5.0


@dataclass
class _Twin:
    """A page-locked buffer and the last call that uses it (free once that call is done)."""

    memory: torch.Tensor  # uint8, page-locked
    last_call: int = 0


class HostRoute:
    """The gated host route of one group (its CUDA ``all_to_all_single`` and
    ``all_gather_into_tensor`` whose tensors are on one device).

    Args:
        group: the group's context (its options, engine and abort).
    """

    def __init__(self, group: GroupContext) -> None:
        self._group = group
        self._validate = group.options.validate and group.size > 1
        self._lock = threading.Lock()  # numbering, twins and queueing: callers' threads
        # Page-locked, one int64 per slot and kind: written by the CPU (gate) or the stream.
        self._flags: torch.Tensor | None = None
        self._gate: np.ndarray | None = None
        self._ready: np.ndarray | None = None
        self._done: np.ndarray | None = None
        self._calls = 0
        self._twins: dict[int, list[_Twin]] = {}
        self._released = False
        self._mismatch: str | None = None  # a routed call's failed validation (``_ended``)
        self._forget_abort = group.on_abort(self.release)
        # Calls queued for the route's thread (None: stop), and how many it has not started.
        self._jobs: queue.SimpleQueue[tuple[Collective, int] | None] = queue.SimpleQueue()
        self._unstarted = 0
        self._started = threading.Condition()  # guards ``_unstarted`` (not ``_lock``: see run)
        self._thread: threading.Thread | None = None

    @staticmethod
    def takes(output: torch.Tensor, input: torch.Tensor) -> bool:
        """Whether a call with these tensors takes the route (else the group's other path:
        mixed devices, which its validation refuses)."""
        return output.is_cuda and input.is_cuda and output.device == input.device

    def run(
        self,
        name: str,
        build: Callable[[torch.Tensor, torch.Tensor], Plan],
        output: torch.Tensor,
        input: torch.Tensor,
        timeout_s: float | None,
    ) -> HostRouteWork:
        """Queues one collective (``build(host_output, host_input)`` plans it on page-locked
        twins of the tensors) and returns its work.

        Raises:
            FreescalePeerError: the group was aborted (nothing is queued).
            FreescaleValidationError: this rank's own arguments are wrong. Under ``validate``
                the call is queued all the same, so that the peers learn of it too; without,
                nothing is queued and the group is aborted, as on the other paths.
        """
        from freescale_comm.collective import Collective
        from freescale_comm.cuda import current_stream

        self._refuse_if_broken(name)
        group = self._group
        device = input.device.index
        stream = current_stream(device).cuda_stream
        with self._lock:
            gate = self._flag_pages()
            number = self._calls = self._calls + 1  # taken for good, whatever happens next
            slot = number % SLOTS
            self.wait_done(number - SLOTS, f"{name}: the call {SLOTS} calls before")
            host_input = self._twin(input, number)
            host_output = self._twin(output, number)
            label = f"freescale {name} (group {group.group_id}, rank {group.rank})"
            plan = None
            if not self._validate:  # this rank's own errors, before anything is queued
                plan = build(host_output, host_input)
                if plan.signature.error:
                    # As ``GroupContext.launch`` does: the peers must not wait for this call.
                    self._done[slot] = number  # nothing queued: its twins are free
                    group.abort(
                        f"rank {group.rank}: {label} could not start: {plan.signature.error}"
                    )
                    raise FreescaleValidationError(f"{label}: {plan.signature.error}")
            try:
                self._queue(stream, device, slot, number, host_input, host_output, input, output)
                # Planned while the GPU copies the input (the output keeps its bytes if the
                # plan is refused: validation fails on every rank).
                if plan is None:
                    plan = build(host_output, host_input)
                op = Collective(group, name, plan, timeout_s)
            except BaseException as err:
                self._open(slot, number)
                group.abort(f"rank {group.rank}: {label} could not be queued: {err}")
                raise
            local_error = plan.signature.error
            if self._released:
                gate[slot] = _OPEN
            op.on_end = lambda: self._ended(op, slot, number)
            with self._started:
                self._unstarted += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve,
                    name="freescale-comm-host-route",
                    daemon=True,
                )
                self._thread.start()
            self._jobs.put((op, number))
        # Written in place, as by an in-place op (``ProcessGroupFreescale._own``).
        torch.autograd.graph.increment_version(output)
        if local_error:
            raise FreescaleValidationError(f"{op.label}: {local_error}")
        return HostRouteWork(self, op, number, output, stream)

    def _refuse_if_broken(self, name: str) -> None:
        """Raises if the group was aborted, or a routed call failed validation (the route's
        thread aborts the group then, maybe not yet)."""
        group = self._group
        broken = group.broken or self._mismatch
        if broken:
            raise FreescalePeerError(
                f"freescale {name} (group {group.group_id}, rank {group.rank}): the group was "
                f"aborted earlier: {broken}"
            )

    def _queue(
        self,
        stream: int,
        device: int,
        slot: int,
        number: int,
        host_input: torch.Tensor,
        host_output: torch.Tensor,
        input: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """Queues call ``number``'s D2H copies, ``ready`` write, gate, H2D and ``done`` write
        on ``stream``, the caller's current one. A strided tensor goes through a contiguous
        copy of it on the device (torch's, on the same stream), as on the other paths."""
        ops = StreamOps()
        # Held until the copies are queued: torch's allocator may hand freed memory out again
        # before a copy queued on the side would run.
        sent = input.contiguous()
        kept = output.contiguous() if self._validate else output
        self._copy_out(ops, stream, host_input, sent)
        if self._validate:  # a failed validation writes the output's own bytes back
            self._copy_out(ops, stream, host_output, kept)
        ops.write(stream, self._address(self._ready, slot), number)
        ops.wait(stream, self._address(self._gate, slot), number)
        landing = output if output.is_contiguous() else torch.empty_like(output).contiguous()
        self._copy_out(ops, stream, landing, host_output)
        if landing is not output:
            ops.run(device)
            output.copy_(landing)
        ops.write(stream, self._address(self._done, slot), number)
        ops.run(device)

    @staticmethod
    def _copy_out(ops: StreamOps, stream: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queues ``dst <- src``, both contiguous, as one driver copy."""
        ops.copy(stream, dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())

    def drain(self) -> None:
        """Blocks until every routed call made before has started (another collective of the
        group is about to), within the group's timeout; aborts the group past it.

        Raises:
            FreescaleError: called on the engine thread while routed calls wait to start (it
                could hold the engine from a collective before them); the group is aborted.
            FreescaleTimeoutError: they did not start within the timeout.
        """
        self._refuse_if_broken("collective")
        with self._started:
            if self._unstarted == 0:
                return
        group = self._group
        group.refuse_wait_on_engine_thread(
            lambda: f"freescale (group {group.group_id}): a collective after host-route calls"
        )
        limit = group.current_timeout_s()
        with self._started:
            if self._started.wait_for(lambda: self._unstarted == 0, limit):
                return
        group.abort(
            f"rank {group.rank}: a collective on the host route did not start within "
            f"{limit:g} s (its input's D2H copy never completed)"
        )
        raise FreescaleTimeoutError("the host route's earlier collectives did not start")

    def is_done(self, number: int) -> bool:
        """Whether call ``number``'s H2D has completed (its ``done`` flag)."""
        done = self._done
        return number < 1 or (done is not None and int(done[number % SLOTS]) >= number)

    def stream_waits_for(self, stream: int, device: int, number: int) -> None:
        """Makes ``stream`` wait for call ``number``'s ``done`` flag (no kernel, no CPU wait)."""
        if self.is_done(number):
            return
        ops = StreamOps()
        ops.wait(stream, self._address(self._done, number % SLOTS), number)
        ops.run(device)

    def _serve(self) -> None:
        """The route's thread: each call's collective, once its D2H is done, in call order."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            op, number = job
            counted = [True]  # still among ``_unstarted``

            def started(counted: list[bool] = counted) -> None:
                if counted[0]:
                    counted[0] = False
                    with self._started:
                        self._unstarted -= 1
                        self._started.notify_all()

            try:
                self._run_one(op, number, started)
            finally:
                started()

    def _run_one(self, op: Collective, number: int, started: Callable[[], None]) -> None:
        """Waits for ``op``'s input, starts it (then calls ``started``) and waits for it."""
        group = self._group
        ready = self._ready
        slot = number % SLOTS
        spin_until = time.monotonic() + _SPIN_S
        while ready[slot] < number:
            if group.broken or self._released:
                op.fail("the group was aborted before its input was copied", "peer")
                return
            if time.monotonic() > op.deadline:
                # This rank never takes the collective's number: every later one would pair
                # with the peers' wrong calls.
                reason = "its input's D2H copy did not complete within its timeout"
                op.fail(reason, "timeout")
                group.abort(f"rank {group.rank}: {op.label}: {reason}")
                return
            time.sleep(0 if time.monotonic() < spin_until else _NAP_S)
        try:
            group.launch(op, caller_waits=True)
        except BaseException as err:  # not started (the group shut down): nothing else opens it
            op.fail(f"it could not start: {err}", "internal")
            return
        started()  # a later collective of the group may start now
        # A small one runs to its end here (the express path). A failure is on ``op``, its
        # gate open.
        try:
            FreescaleWork(op).wait()
        except FreescaleValidationError:
            # Every rank found the same mismatch; the callers have returned, so the group's
            # next call on each rank raises it (``_mismatch``, set as the collective ended).
            group.abort(self._mismatch or "a host-route collective failed validation")
        except FreescaleError:
            pass

    def _twin(self, tensor: torch.Tensor, number: int) -> torch.Tensor:
        """A page-locked buffer shaped as ``tensor``, free of earlier calls, for call
        ``number``."""
        nbytes = tensor.numel() * tensor.element_size()
        size_class = max(_MIN_TWIN_BYTES, 1 << max(0, nbytes - 1).bit_length())
        twins = self._twins.setdefault(size_class, [])
        free = next((t for t in twins if self.is_done(t.last_call)), None)
        if free is None and len(twins) < _TWINS_PER_CLASS:
            free = _Twin(torch.empty(size_class, dtype=torch.uint8, pin_memory=True))
            twins.append(free)
        if free is None:
            free = min(twins, key=lambda t: t.last_call)
            self.wait_done(free.last_call, "an earlier call's page-locked buffer")
        free.last_call = number
        return free.memory[:nbytes].view(tensor.dtype).view(tensor.shape)

    def wait_done(self, number: int, what: str) -> None:
        """Waits (bounded by the group's timeout) until call ``number`` is done (nothing to
        wait for where ``number`` < 1)."""
        if self.is_done(number):
            return
        deadline = time.monotonic() + self._group.current_timeout_s()
        while not self.is_done(number):
            if time.monotonic() > deadline:
                raise FreescaleTimeoutError(
                    f"freescale (group {self._group.group_id}): {what} did not complete on its "
                    "stream within the group timeout"
                )
            time.sleep(_NAP_S)

    def _flag_pages(self) -> np.ndarray:
        """The gate page (the three pages made on the first call)."""
        if self._flags is None:
            self._flags = torch.zeros(3, SLOTS, dtype=torch.int64, pin_memory=True)
            self._gate, self._ready, self._done = self._flags.numpy()
        return self._gate

    @staticmethod
    def _address(page: np.ndarray, slot: int) -> int:
        return page.ctypes.data + 8 * slot

    def _ended(self, op: Collective, slot: int, number: int) -> None:
        """``op`` (call ``number``) has ended: a mismatch is kept for the next call, and the
        stream goes on. Under the collective's lock: no lock, no abort here."""
        if isinstance(op.error, FreescaleValidationError) and self._mismatch is None:
            self._mismatch = f"rank {self._group.rank}: {op.error}"
        self._open(slot, number)

    def _open(self, slot: int, number: int) -> None:
        """Call ``number``'s collective has ended: its stream goes on (the slot only grows)."""
        gate = self._gate
        if gate[slot] < number:
            gate[slot] = number

    def release(self) -> None:
        """Opens every gate, queued or to come (the group was aborted). Takes no lock: a
        caller may hold ``_lock`` while it waits on the GPU for a gate this opens."""
        self._released = True
        gate = self._gate
        if gate is not None:
            gate[:] = _OPEN

    def close(self) -> None:
        """The group is destroyed: calls not started fail, every gate opens, and the memory is
        freed once the last call is done (kept forever where it is not within a few
        seconds: a stream may still use it)."""
        self.release()
        self._forget_abort()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(1.0)  # a collective it still waits for fails with the group
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].fail("the process group was shut down", "internal")
        deadline = time.monotonic() + _CLOSE_WAIT_S
        while not self.is_done(self._calls) and time.monotonic() < deadline:
            time.sleep(_NAP_S)
        if not self.is_done(self._calls):
            _RETIRED.append((self._flags, self._twins))
        self._twins = {}


class HostRouteWork(dist.Work):
    """The work of a collective on the host route: ``wait`` makes the caller's current stream
    wait for the call's H2D and returns, raising the collective's error once it is known."""

    def __init__(
        self, route: HostRoute, op: Collective, number: int, output: torch.Tensor, stream: int
    ) -> None:
        super().__init__()
        self._route = route
        self._op = op
        self._number = number
        self._output = output
        self._stream = stream  # the call's: stream order already puts later work behind it

    def wait(self, timeout: timedelta | None = None) -> bool:
        from freescale_comm.cuda import current_stream

        if self._op.error is not None:
            raise self._op.error
        device = self._output.device.index
        stream = current_stream(device).cuda_stream
        if stream != self._stream:
            self._route.stream_waits_for(stream, device, self._number)
        return True

    def is_completed(self) -> bool:
        return self._op.event.is_set() and self._route.is_done(self._number)

    def is_success(self) -> bool:
        return self.is_completed() and self._op.error is None

    def exception(self) -> BaseException | None:
        return self._op.error

    def get_future(self) -> torch.futures.Future:
        """Completes with ``[output]`` once the collective has ended (its H2D may still be
        queued: a caller that reads the output on another stream waits for the work)."""
        output = self._output
        return self._op.future.then(lambda _: [output])

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return [self._output]

    def synchronize(self) -> None:
        """Blocks until the collective has ended and its H2D is done (bounded by its
        timeout)."""
        op = self._op
        op.await_finish()
        if not op.event.is_set():
            raise FreescaleTimeoutError(f"{op.label}: not finished within its timeout")
        if op.error is not None:
            raise op.error
        self._route.wait_done(self._number, f"{op.label}'s H2D")
