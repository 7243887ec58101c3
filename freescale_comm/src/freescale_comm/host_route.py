"""CUDA collectives through the host path, the caller's stream gated on the GPU.

``cuda_path="host"``.

For a small collective on a GPU that two processes share without MPS, the copy-engine paths pay
the two contexts' time slices several times over; moving the bytes through page-locked host
memory and the group's CPU path (outboxes, rings, reads of the peer's memory, UCX between hosts)
pays them twice (``benchmarks/results/comm_gpu/value_gate_probe/``). A call queues on the
caller's current stream, and returns:

1. a D2H copy of the input into a page-locked twin, and an event after it;
2. a gate: ``cuStreamWaitValue64`` on this call's slot of a page-locked flag page;
3. an H2D copy of the output's page-locked twin into the output, and the end event.

A thread of the route's own takes the calls in order: it waits for a call's D2H, then starts
the collective of the twins on the group's CPU path and waits for it as a synchronous caller
does (so that a small one runs to its end on that thread: the express path); when it ends,
succeeded or failed, the CPU writes the slot and the stream goes on. The engine thread, woken
by a watcher of the D2H's event, would add its hand-offs (0.55 ms per 8-byte call back to back
against 0.34 over IPC, measured). No kernel, no CPU wait for the GPU on the caller's thread,
no host function (a gate run by the driver's host-function thread blocks the caller once
about 57 calls wait behind closed gates, ``value_gate_probe/host_function_gate/``).

Collectives start in call order on every rank: the thread starts the routed ones in the order
they were called, and any other collective of the group waits until those called before it
have started (``drain``).

There is no verdict before the output is written (the group must be made with
``validate=False``): a collective that fails (a dead peer, the timeout, the group aborted or
destroyed) opens its gate all the same, so that the stream does not hang, and its output then
holds whatever the twin held. Its ``Work`` raises the error once it is known.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from freescale_comm.errors import FreescaleError, FreescalePeerError, FreescaleTimeoutError
from freescale_comm.stream_ops import StreamOps
from freescale_comm.work import FreescaleWork

if TYPE_CHECKING:
    from freescale_comm.algorithms import Plan
    from freescale_comm.collective import Collective
    from freescale_comm.group import GroupContext

# Gates in flight per group: a call whose slot an unfinished call still holds waits for it.
SLOTS = 1024
# Written into every slot on an abort: passes every wait queued before or after.
_OPEN = 1 << 62
# Flag pages of destroyed groups: a stream may still wait on one (never freed, 8 KiB each).
_RETIRED: list[torch.Tensor] = []
# How the route's thread waits for a call's D2H: polls with yields for this long (a small
# collective's copy behind little work), then sleeps this long between polls.
_SPIN_S = 0.0005
_NAP_S = 0.0005


class HostRoute:
    """The gated host route of one group (its CUDA ``all_to_all_single`` and
    ``all_gather_into_tensor`` of contiguous tensors on one device).

    Args:
        group: the group's context (its engine, CUDA watchers and abort).
    """

    def __init__(self, group: GroupContext) -> None:
        self._group = group
        self._lock = threading.Lock()  # numbering and queueing: callers' threads
        self._flags: torch.Tensor | None = None  # page-locked, one int64 slot per gate
        self._values: np.ndarray | None = None
        self._calls = 0
        self._slot_ends: list[torch.cuda.Event | None] = [None] * SLOTS
        self._released = False
        self._forget_abort = group.on_abort(self.release)
        # Calls queued for the route's thread (None: stop), and how many it has not started.
        self._jobs: queue.SimpleQueue[tuple[Collective, torch.cuda.Event] | None] = (
            queue.SimpleQueue()
        )
        self._unstarted = 0
        self._started = threading.Condition()  # guards ``_unstarted`` (not ``_lock``: see run)
        self._thread: threading.Thread | None = None

    @staticmethod
    def takes(output: torch.Tensor, input: torch.Tensor) -> bool:
        """Whether a call with these tensors takes the route (else the group's other path)."""
        return (
            output.is_cuda
            and input.is_cuda
            and output.device == input.device
            and output.is_contiguous()
            and input.is_contiguous()
        )

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
        """
        from freescale_comm.collective import Collective
        from freescale_comm.cuda import current_stream

        group = self._group
        if group.broken:
            raise FreescalePeerError(
                f"freescale {name} (group {group.group_id}, rank {group.rank}): the group was "
                f"aborted earlier: {group.broken}"
            )
        host_input = torch.empty(input.shape, dtype=input.dtype, pin_memory=True)
        host_output = torch.empty(output.shape, dtype=output.dtype, pin_memory=True)
        plan = build(host_output, host_input)
        op = Collective(group, name, plan, timeout_s)
        device = input.device.index
        stream = current_stream(device)
        with self._lock:
            flags, values = self._flag_page()
            self._calls += 1
            number, slot = self._calls, self._calls % SLOTS
            earlier = self._slot_ends[slot]
            if earlier is not None:
                earlier.synchronize()  # SLOTS calls behind: the oldest one's gate has passed
            with torch.cuda.stream(stream):
                host_input.copy_(input, non_blocking=True)
                ready = torch.cuda.Event()  # polled by the route's thread
                ready.record(stream)
                gate = StreamOps()
                gate.wait(stream.cuda_stream, flags.data_ptr() + 8 * slot, number)
                gate.run(device)
                try:
                    output.copy_(host_output, non_blocking=True)
                    end = torch.cuda.Event()
                    end.record(stream)
                except BaseException:
                    self._open(slot, number)
                    raise
            self._slot_ends[slot] = end
            if self._released:
                values[slot] = _OPEN
            op.on_end = lambda: self._open(slot, number)
            with self._started:
                self._unstarted += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve,
                    args=(device,),
                    name="freescale-comm-host-route",
                    daemon=True,
                )
                self._thread.start()
            self._jobs.put((op, ready))
        # Written in place, as by an in-place op (``ProcessGroupFreescale._own``).
        torch.autograd.graph.increment_version(output)
        return HostRouteWork(op, end, output)

    def drain(self) -> None:
        """Blocks until every routed call made before has started (another collective of the
        group is about to), within the group's timeout; aborts the group past it."""
        limit = self._group.current_timeout_s()
        with self._started:
            if self._started.wait_for(lambda: self._unstarted == 0, limit):
                return
        self._group.abort(
            f"rank {self._group.rank}: a collective on the host route did not start within "
            f"{limit:g} s (its input's D2H copy never completed)"
        )
        raise FreescaleTimeoutError("the host route's earlier collectives did not start")

    def _serve(self, device: int) -> None:
        """The route's thread: each call's collective, once its D2H is done, in call order."""
        torch.cuda.set_device(device)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            op, ready = job
            counted = [True]  # still among ``_unstarted``

            def started(counted: list[bool] = counted) -> None:
                if counted[0]:
                    counted[0] = False
                    with self._started:
                        self._unstarted -= 1
                        self._started.notify_all()

            try:
                self._run_one(op, ready, started)
            finally:
                started()

    def _run_one(
        self, op: Collective, ready: torch.cuda.Event, started: Callable[[], None]
    ) -> None:
        """Waits for ``op``'s input, starts it (then calls ``started``) and waits for it."""
        group = self._group
        spin_until = time.monotonic() + _SPIN_S
        while not ready.query():
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
        with contextlib.suppress(FreescaleError):
            FreescaleWork(op).wait()

    def _flag_page(self) -> tuple[torch.Tensor, np.ndarray]:
        if self._flags is None:
            self._flags = torch.zeros(SLOTS, dtype=torch.int64, pin_memory=True)
            self._values = self._flags.numpy()
        return self._flags, self._values

    def _open(self, slot: int, number: int) -> None:
        """Call ``number``'s collective has ended: its stream goes on (the slot only grows)."""
        values = self._values
        if values[slot] < number:
            values[slot] = number

    def release(self) -> None:
        """Opens every gate, queued or to come (the group was aborted). Takes no lock: a
        caller may hold ``_lock`` while it waits on the GPU for a gate this opens."""
        self._released = True
        values = self._values
        if values is not None:
            values[:] = _OPEN

    def close(self) -> None:
        """The group is destroyed: calls not started fail, every gate opens, and the flag page
        is kept for the streams that may still wait on it."""
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
        if self._flags is not None:
            _RETIRED.append(self._flags)


class HostRouteWork(dist.Work):
    """The work of a collective on the host route: ``wait`` makes the caller's current stream
    wait for the end event and returns, raising the collective's error once it is known."""

    def __init__(self, op: Collective, end: torch.cuda.Event, output: torch.Tensor) -> None:
        super().__init__()
        self._op = op
        self._end = end
        self._output = output

    def wait(self, timeout: timedelta | None = None) -> bool:
        from freescale_comm.cuda import current_stream

        if self._op.error is not None:
            raise self._op.error
        current_stream(self._output.device.index).wait_event(self._end)
        return True

    def is_completed(self) -> bool:
        return self._op.event.is_set() and self._end.query()

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
        self._end.synchronize()
