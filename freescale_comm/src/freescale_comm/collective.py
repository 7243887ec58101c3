"""One collective in flight: validation header round, then the plan's messages, then completion.

State machine (driven by the engine thread, or by a caller that waits on it; the caller thread
starts it):

1. ``header``: every rank sends its signature to every peer and receives theirs (tag index 0);
   all ranks then judge the same table (``validation.judge``: fixed-size headers with digests of
   the size table; only after the digests disagree, ``diagnose``, a second round with the whole
   table names the culprit). A mismatch fails the collective on every rank with the same
   message, no output byte written; the group stays usable. On the
   CPU, data for a peer of at most ``eager_bytes`` (less in groups of more than 65 ranks: 4 MiB
   of header room per collective at most) travels inside the header message (into a receive
   buffer with that much room) and is copied to the outputs once the verdict is good: a small
   collective is then one message per peer and one round trip, not two. CUDA data folds the
   same way through page-locked host memory: a copy engine moves it D2H once the caller's
   stream has produced it, the header leaves when that copy is done, and the receiver's H2D
   copies are queued with the data phase (so a small CUDA collective skips UCX's device-memory
   rendezvous, which costs hundreds of microseconds per message). To the peers on its host a
   rank writes its header messages into its outbox instead (``outbox``), which they read in
   place; CPU data for them folds up to the outbox's share (``GroupContext.fold_limit``).
2. ``ready``: the direct CUDA path waits until the work queued on the caller's stream before the
   call has finished (UCX is not stream-aware and reads device memory itself); the staged and
   IPC paths do not wait on the CPU: their streams wait for that work on the GPU (an IPC part
   is queued in this phase, before the CPU wait its collective's UCX messages need).
3. ``data``: local copies, then either every message posted (CPU, direct CUDA; ring forwards as
   soon as the receive they forward has completed) or the staged pipeline (``staged``). A CPU
   piece that a peer on this host reads from the sender's memory travels as its address in the
   sender's header instead (``named_reads``): read once the verdict is good, the peers'
   outboxes released only then, and the sender complete once its readers have released its.
4. ``sealed`` (CUDA): every copy is enqueued, the last one followed by the collective's end
   event (``work.wait()`` makes the caller's stream wait for it). The collective finishes (its
   future completed) once that event has: at once where somebody waits for it (a watcher
   thread), else when a poll finds it (``poll_final``).

A small CPU collective whose every piece rides in the outboxes' headers (or is read at the
address a header names), alone in flight, may run the whole machine in its call (``_express``;
an asynchronous one only with reads of ``INLINE_READ_BYTES`` or less): headers written and read,
the table judged (compared as bytes with one judged good before, for a cached shape), the
pieces copied out; whatever it cannot finish that way it leaves in the state of phase 1.

A failure at any point cancels the outstanding requests (dropping a ucxx request cancels it) but
keeps the buffers referenced by the group, so a late UCX access never touches freed memory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from freescale_comm import named_reads
from freescale_comm.algorithms import Plan, Transfer
from freescale_comm.engine import POLL_S, yield_core
from freescale_comm.errors import (
    FreescaleError,
    FreescalePeerError,
    FreescaleTimeoutError,
    FreescaleValidationError,
)
from freescale_comm.futures import CollectiveFuture
from freescale_comm.local_copies import INLINE_READ_BYTES, host_copies
from freescale_comm.transport import make_tag
from freescale_comm.validation import (
    NEEDS_TABLE,
    Signature,
    judge,
    judge_table,
    names_ipc,
    with_own_error,
)

if TYPE_CHECKING:
    from freescale_comm.cuda import CopyStreams, CudaSupport
    from freescale_comm.group import GroupContext
    from freescale_comm.ipc import Export, GatedPulls, IpcPath, Piece
    from freescale_comm.local_copies import PendingCopies
    from freescale_comm.staged import StagedPipeline

_ERRORS: dict[str, type[FreescaleError]] = {
    "validation": FreescaleValidationError,
    "timeout": FreescaleTimeoutError,
    "peer": FreescalePeerError,
    # A peer destroyed the group before finishing it: every rank learns that itself, so the
    # group is not aborted (its earlier collectives may still finish).
    "departed": FreescalePeerError,
    "internal": FreescaleError,
    # It raised on this rank (a bug, the OS refusing memory): its peers wait for its messages.
    "raised": FreescaleError,
}


class _NotSealed:
    """``Collective.sealed`` of a CPU collective, which has no CUDA copies to seal."""

    def set(self) -> None:
        pass

    def is_set(self) -> bool:
        return False


_NOT_SEALED = _NotSealed()


@dataclass(frozen=True)
class _ExpressLayout:
    """Where a CPU plan's bytes go when every one of its messages travels inside the headers
    between outboxes, or as an address in them (``named_reads``), read on the calling thread
    (``Collective._express``), by index into ``plan.transfers``."""

    # (peer, its folded sends, or those it reads), in the order headers go
    sends: list[tuple[int, list[int]]]
    readers: list[int]  # the peers of ``sends`` that read this rank's pieces
    receives: list[tuple[int, list[tuple[int, int, int]]]]  # (peer, [(receive, lo, hi)])
    reads: list[tuple[int, list[int]]]  # (peer, the receives read from its memory)
    sources: list[int]  # the peers whose headers are read, in the order the general path reads
    header_bytes: int  # the signature's part of each header
    read_bytes: int  # the bytes of ``reads``


_EXPRESS_KEY = "express"  # ``Template.derived`` key of the layout (None: the plan has none)
# Header tables a template remembers as judged consistent (``Template.derived["good"]``).
_GOOD_TABLES = 16


# Slack past the group timeout: the engine fails an expired collective itself (naming the
# missing peers); a wait that outlives that by this much means the engine thread is gone.
WAIT_SLACK_S = 5.0


class _Done:
    """``Collective.event`` and ``sealed``: a ``threading.Event`` made only if a thread must
    block on it (making one costs microseconds; most collectives are driven to their end by the
    caller, which then finds it set)."""

    __slots__ = ("_event", "_set")
    _lock = threading.Lock()

    def __init__(self) -> None:
        self._set = False
        self._event: threading.Event | None = None

    def set(self) -> None:
        with self._lock:
            self._set = True
            event = self._event
        if event is not None:
            event.set()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        if self._set:
            return True
        with self._lock:
            if self._set:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)


class Collective:
    """A collective of one group in flight (see the module docstring)."""

    def __init__(
        self, group: GroupContext, name: str, plan: Plan, timeout_s: float | None = None
    ) -> None:
        self.group = group
        self.name = name
        self.plan = plan
        self.seq = 0  # numbered by ``GroupContext.launch``, in the order collectives start
        self.started = time.monotonic()
        self.launched_by = threading.get_ident()  # made by the calling thread
        # The call's own timeout, or the group's at the start: one set later
        # (``follow_timeout``) bounds the collectives started after it.
        self.timeout_s = timeout_s or group.current_timeout_s()
        self.deadline = self.started + self.timeout_s
        self.finished = False
        self.error: FreescaleError | None = None
        self.event = _Done()
        # CUDA: set once every copy is enqueued and ``final`` recorded (or the collective failed).
        self.on_cuda = plan.on_cuda  # read on every step: the plan derives it from its signature
        self.idle_poll_s = group.idle_poll_s
        self.alone_yields = group.alone_yields
        self.sealed = _Done() if self.on_cuda else _NOT_SEALED
        # IPC reaches only some peers: the others take the remote path in this collective.
        self._ipc_partial = plan.ipc and len(plan.ipc_peers) < group.size - 1
        # Staged CUDA collective whose every peer is reached through the staging rings: its
        # data leaves with the headers (no folding, no CPU wait for a D2H copy).
        self.ring_cuda = False
        self._ring_events: list[torch.cuda.Event] = []  # ends of the rings' H2D copies
        # Made when asked for (``future``): most synchronous calls never ask.
        self._future: CollectiveFuture | None = None
        self._future_lock = threading.Lock()
        self._outcome: tuple[bool, Any] | None = None
        self._completing_in: int | None = None  # the thread completing the future, meanwhile
        self._lock = threading.Lock()
        self._abort_reason: str | None = None
        self._phase = "header"
        # Started without a header round (validate=False): no verdict waits for the peers to
        # reach this collective, so its data waits for the earlier ones' (``_start_data``).
        self._unheaded = False
        self._data_posted = False  # CPU: every message of the data phase posted (or queued)
        self._local_pending: PendingCopies | None = None  # CPU: own pieces on helper threads
        self._posted: list[Transfer] = []
        self._unposted: list[Transfer] = []
        self._headers: list[Any] = []
        # Headers through the group's outboxes (``outbox``): this collective's number there,
        # the messages still to write ((peer, parts); None once written), the peers still to
        # read from (whether into page-locked memory), whether it is done reading.
        self._outbox_seq = 0
        self._outbox_msgs: list[tuple[int, list[Any]]] | None = None
        self._outbox_from: dict[int, bool] = {}
        self._outbox_released = False
        self._folded: set[int] = set()  # ids of transfers that travel inside a header
        # Pieces read at the addresses the senders' headers name (``named_reads``): ids of the
        # transfers, the reads to start (once judged), the reads started, the peers that read
        # this rank's pieces, and whether the reads were named (judged good: from then on a
        # failure keeps the peers' outboxes, whose release would say their pieces were read).
        self._named: set[int] = set()
        self._named_from: dict[int, list[Transfer]] = {}  # the receives read, per peer
        self._named_receives: list[tuple[int, Any, int, np.ndarray]] = []
        self._reading: named_reads.PendingReads | None = None
        self._readers: list[int] = []
        self._reads_named = False
        # ids of sends posted with the headers (shared-memory rings only): the receiver keeps
        # them out of its outputs until the verdict, so they need not wait for it.
        self._early: set[int] = set()
        # CUDA folding: headers waiting for their data's D2H copy (event, [(peer, message)]),
        # the H2D copies of received folded data (device bytes, pinned host bytes), and the
        # page-locked buffers, referenced until the collective's copies are done.
        self._unloaded_headers: tuple[torch.cuda.Event, list[tuple[int, Any]]] | None = None
        self._folded_loads: list[tuple[torch.Tensor, np.ndarray]] = []
        self._folded_done: torch.cuda.Event | None = None
        self._pinned: list[torch.Tensor] = []
        self._ready: torch.cuda.Event | None = None
        self._cuda: CudaSupport | None = None
        self._streams: CopyStreams | None = None
        self._local_done: torch.cuda.Event | None = None
        self._pipeline: StagedPipeline | None = None
        self._ipc: IpcPath | None = None  # IPC: the group's path on this device
        self._export: Export | None = None  # IPC: where this rank's pieces lie, for the peers
        self._pulls: dict[int, list[tuple[Any, Piece]]] = {}  # IPC: where the peers' lie
        # IPC: the peers that pushed into this rank's mailbox: slot, (receive, where) per piece
        self._pushed_in: dict[int, tuple[int, list[tuple[Any, Piece]]]] = {}
        self._pushed_slots: dict[int, int] = {}  # ... their slots, read before the verdict
        self._ipc_done: torch.cuda.Event | None = None  # IPC part queued, others still to come
        self._ipc_gated: GatedPulls | None = None  # IPC pulls left to the CPU (a shared GPU)
        self.final: torch.cuda.Event | None = None  # the CUDA end event, once sealed
        # A sealed CUDA collective without a pipeline finishes once ``final`` has completed:
        # found by a poll (``poll_final``) unless somebody waits for it (``finish_promptly``),
        # which hands ``final`` to a watcher thread. Guarded by ``_future_lock``.
        self._final_watcher: Any = None  # the watcher ``final`` goes to once asked for
        self._prompt = False  # somebody waits: ``final`` goes to the watcher once sealed

    @property
    def future(self) -> CollectiveFuture:
        """The collective's future (its outputs, or its error), made on first use."""
        with self._future_lock:
            if self._future is None:
                self._future = CollectiveFuture(self.group.callbacks)
                if self._outcome is not None:
                    self._future.complete(*self._outcome)
            future = self._future
        self.finish_promptly()
        return future

    def finish_promptly(self) -> None:
        """Somebody waits for this collective's end (its future, ``synchronize``): a CUDA one
        left to its end event then finishes as soon as the event completes, on a watcher
        thread, rather than at the next poll."""
        if self.finished or not self.on_cuda:  # a CPU one has no end event
            return
        with self._future_lock:
            if self._prompt:
                return
            self._prompt = True
            watcher = self._final_watcher
        if watcher is not None:
            watcher.watch(self.final, self._finish_after_final)

    def await_finish(self) -> None:
        """Blocks until this collective has finished, succeeded or failed, at most until the
        slack past its deadline (the engine fails it at the deadline). Drives nothing: a
        claimed collective is driven by the thread that claimed it, the others by the engine
        thread."""
        self.finish_promptly()
        self.event.wait(max(0.0, self.deadline + WAIT_SLACK_S - time.monotonic()))

    def poll_final(self, awaited_too: bool = False) -> None:
        """Finishes a sealed CUDA collective whose end event has completed (a cheap query;
        a collective in any other state is left alone). One that somebody waits for is left to
        its watcher unless ``awaited_too``: completing its future here would run the callbacks
        C++ chained to it (``collect_all``) on the polling thread."""
        if self.finished or self._final_watcher is None or (self._prompt and not awaited_too):
            return
        try:
            done = self.final.query()
        except RuntimeError as err:  # a CUDA error: the stream's work is lost
            self._finish_after_final(f"its CUDA copies failed: {err}")
            return
        if done:
            self._finish_after_final(None)

    def _set_outcome(self, ok: bool, value: Any) -> None:
        with self._future_lock:
            self._outcome = (ok, value)
            future = self._future
        if future is not None:
            # No Python callback runs here (on the engine thread, under the collective's
            # lock): the group's callback thread runs them (``futures``). Those C++ chained
            # (``collect_all``) do run here, before ``event`` is set.
            self._completing_in = threading.get_ident()
            try:
                future.complete(ok, value)
            finally:
                self._completing_in = None

    def outcome_set(self) -> bool:
        """Whether the collective has ended and its outcome is set (its future completes with
        it; ``event`` is set after)."""
        return self._outcome is not None

    def completing_here(self) -> bool:
        """Whether the calling thread is completing this collective's future (and so runs
        the callbacks C++ chained to it): its outcome is set, its ``event`` not yet."""
        return self._completing_in == threading.get_ident()

    @property
    def label(self) -> str:
        return f"freescale {self.name} #{self.seq} ({self.group.where})"

    # ----------------------------------------------------------------- start (caller thread)
    def start(self, express: bool = False, caller_waits: bool = True) -> None:
        """Posts the first messages; raises at once only when the group is already broken.

        With ``express`` (no other collective of the group is in flight) a small CPU collective
        whose messages all fit in the outboxes is run to its end here when the peers' headers
        arrive within the group's poll window (``_express``); otherwise it is left in flight,
        in the state the general path would have left it. An asynchronous call (not
        ``caller_waits``) runs there only where its reads of peers' memory add up to
        ``INLINE_READ_BYTES`` or less, and polls for its peers for at most ``POLL_S``: handed
        to the engine thread instead, a small one took 2-4x as long (two hand-offs between
        threads), and its caller is kept from its work about as long as by a small synchronous
        call.
        """
        g = self.group
        if g.broken:
            raise FreescalePeerError(f"{self.label}: the group was aborted earlier: {g.broken}")
        if self.on_cuda:
            self._cuda = g.cuda(self.plan.cuda_index)
            self._ready = self._cuda.record_ready()
            if not self.plan.gpu_ordered:
                self._cuda.ready_watch.watch(self._ready)
            self.ring_cuda = (
                self.plan.staged and not self.plan.forwarding and g.all_on_staging_rings
            )
        validate = g.options.validate and g.size > 1
        if not validate and self.plan.signature.error:
            raise FreescaleValidationError(f"{self.label}: {self.plan.signature.error}")
        if validate and express and not self.on_cuda and g.outboxes is not None:
            layout = self._express_layout()
            if layout is not None and (caller_waits or layout.read_bytes <= INLINE_READ_BYTES):
                poll_s = self.idle_poll_s if caller_waits else min(self.idle_poll_s, POLL_S)
                self._express(layout, poll_s)
                return
        if validate or (self.plan.ipc and g.size > 1):  # IPC: the headers carry descriptors
            self._post_headers()
        else:
            self._phase = "ready"
            self._unheaded = True
        if self._posted:  # headers written to the outboxes only need no progress call
            g.transport.progress()

    def _express_layout(self) -> _ExpressLayout | None:
        """The express layout of this call (kept with its template, if it has one), or None: a
        peer not reached by outbox, a message too large to fold and not read at a named
        address, reads of more than ``INLINE_READ_BYTES`` in all where the rank has reader
        threads, or an own piece large enough for the helper threads."""
        template = self.plan.template
        if template is None:  # splits that change from call to call: made for this call
            return self._make_express_layout()
        try:
            return template.derived[_EXPRESS_KEY]
        except KeyError:
            layout = template.derived[_EXPRESS_KEY] = self._make_express_layout()
            return layout

    def _make_express_layout(self) -> _ExpressLayout | None:
        """``_express_layout``'s answer, worked out from the plan."""
        g, plan = self.group, self.plan
        peers = [(g.rank + step) % g.size for step in range(1, g.size)]
        if not (
            all(g.reaches_by_outbox(peer) for peer in peers)
            and self._may_fold()
            and not plan.copy_back
            and not g.local_copies.on_helpers(plan.local_copies)
        ):
            return None
        index = {id(t): k for k, t in enumerate(plan.transfers)}
        size = Signature.size(g.size)
        sends = self._foldable(send=True)
        read_sends, reads = self._named_reads(send=True), self._named_reads(send=False)
        read_bytes = sum(len(t.buffer) for received in reads.values() for t in received)
        if read_bytes > INLINE_READ_BYTES and g.local_copies.threads >= 2:
            return None  # reads on reader threads: the general path waits for them
        received: dict[int, list[tuple[int, int, int]]] = {}
        for peer, transfer, lo, hi in self._folded_receives(size):
            received.setdefault(peer, []).append((index[id(transfer)], lo, hi))
        carried = sum(map(len, sends.values())) + sum(map(len, received.values()))
        carried += sum(map(len, read_sends.values())) + sum(map(len, reads.values()))
        if carried != len(plan.transfers):
            return None
        sources = [(g.rank - step) % g.size for step in range(1, g.size)]
        return _ExpressLayout(
            sends=[
                (p, [index[id(t)] for t in read_sends.get(p) or sends.get(p, [])]) for p in peers
            ],
            readers=list(read_sends),
            receives=list(received.items()),
            reads=[(p, [index[id(t)] for t in reads[p]]) for p in sources if p in reads],
            sources=sources,
            header_bytes=size,
            read_bytes=read_bytes,
        )

    def _express(self, layout: _ExpressLayout, poll_s: float) -> None:
        """Runs a collective of ``layout`` on the calling thread: writes the headers (with
        every piece folded in, or the address of a piece its peer reads), polls the peers'
        outboxes for up to ``poll_s``, and, if their headers came and form a
        consistent table (one judged so before for this template, or judged here), copies the
        pieces out, reads the pieces named, and finishes once the peers have read its own
        within the window too. A box not yet writable, a late peer, a table with a problem, an
        abort or another thread waiting to start a collective of the group leaves it as the
        general path's ``_post_headers`` and ``_read_outboxes`` would have; readers not done
        within the window, or a failed read, leave it in the data phase. The engine or the
        caller's wait goes on from there. The same bytes reach the outboxes either way, so
        peers on either path pair up."""
        g, plan = self.group, self.plan
        boxes = g.outboxes
        transfers = plan.transfers
        own = self._own_header()
        self._outbox_seq = seq = g.next_outbox_seq()
        messages = []
        offered: list[np.ndarray] = []
        for peer, sent in layout.sends:
            pieces = [transfers[i].buffer for i in sent]
            if peer not in layout.readers:
                messages.append((peer, [own, *pieces]))
                continue
            offered += pieces
            messages.append((peer, [own, named_reads.addresses(pieces)]))
        if offered:
            g.offer_to_readers(offered, self._tag(g.rank, 0, True))
        headers = [None] * g.size
        headers[g.rank] = own
        if not boxes.writable(seq):
            self._leave_express(layout, messages, headers, layout.sources)
            return
        boxes.write(seq, messages)
        waiting, until = layout.sources, 0.0
        while True:
            missing = []
            for peer in waiting:
                if boxes.arrived(peer, seq):
                    headers[peer] = boxes.read(peer, seq)
                else:
                    missing.append(peer)
            if not missing:
                break
            waiting = missing
            if not until:
                until = time.monotonic() + poll_s
            if not self._polls_on(until):
                self._leave_express(layout, None, headers, waiting)
                return
        if self._verdict(headers, layout.header_bytes) is not None:
            # A problem, or size digests that differ: ``_judge`` names it on every rank.
            self._leave_express(layout, None, headers, [])
            return
        reads = []
        for peer, received in layout.reads:
            found = named_reads.decode(headers[peer], layout.header_bytes, len(received))
            if found is None:  # ``_judge`` fails it, naming the peer
                self._leave_express(layout, None, headers, [])
                return
            channel = g.reader_of(peer)
            for address, i in zip(found, received, strict=True):
                reads.append((peer, channel, address, transfers[i].buffer))
        for peer, spans in layout.receives:
            message = headers[peer]
            for index, lo, hi in spans:
                transfers[index].buffer[:] = message[lo:hi]
        if reads or layout.readers:
            self._reads_named, self._readers = True, layout.readers
            reading = named_reads.PendingReads(reads, 1, g.transport.wake)
            if reading.failure() is not None:  # the engine fails it, outside the launch lock
                self._leave_express_in_data(reading)
                return
        boxes.release(seq)
        self._outbox_released = True
        host_copies(plan.local_copies)
        if layout.readers and not self._poll_readers(poll_s):
            self._leave_express_in_data(None)
            return
        g.express_runs += 1  # under the group's launch lock
        # Finished as ``_finish`` would, but never listed in flight: nothing to retire.
        self._phase = "data"
        self._outbox_released = self.finished = True
        self._set_outcome(True, plan.result if plan.value is None else plan.value)
        self.event.set()

    def _leave_express(
        self,
        layout: _ExpressLayout,
        unwritten: list[tuple[int, list[Any]]] | None,
        headers: list[Any],
        waiting: list[int],
    ) -> None:
        """Leaves an express collective to the general path, in the state its
        ``_post_headers`` and ``_read_outboxes`` would have left: the header messages not
        written yet (``unwritten``), the headers read, the peers still to read from."""
        transfers = self.plan.transfers
        self._outbox_msgs = unwritten
        readers = layout.readers
        for peer, sent in layout.sends:
            carried = self._named if peer in readers else self._folded
            carried.update(id(transfers[i]) for i in sent)
        self._named_from = {p: [transfers[i] for i in received] for p, received in layout.reads}
        self._named.update(id(t) for received in self._named_from.values() for t in received)
        self._readers = layout.readers
        self._headers = headers
        self._outbox_from = dict.fromkeys(waiting, False)

    def _poll_readers(self, poll_s: float) -> bool:
        """Polls, for up to ``poll_s``, until the peers that read this rank's pieces have read
        them; False if they have not by then (or the group broke, or another thread waits to
        start a collective)."""
        boxes, seq, readers = self.group.outboxes, self._outbox_seq, self._readers
        until = time.monotonic() + poll_s
        while not boxes.reads_done(seq, readers):
            if not self._polls_on(until):
                return False
        return True

    def _polls_on(self, until: float) -> bool:
        """Whether an express collective waiting for its peers polls again (after yielding its
        core): not past ``until``, the group neither broken nor wanted by another thread, and
        its yields still find other threads on the core (``yield_core``)."""
        g = self.group
        return (
            time.monotonic() < until
            and not g.broken
            and not g.launch_waiting
            and yield_core(self.alone_yields)
        )

    def _leave_express_in_data(self, failed: named_reads.PendingReads | None) -> None:
        """Leaves an express collective to the general path in its data phase: its own pieces
        copied and its reads done (or ``failed``, which the first advance reports), waiting
        for its readers."""
        self._phase = "data"
        self._data_posted = True
        self._reading = failed

    def _own_header(self) -> np.ndarray:
        """This rank's header (its template's, encoded once, where the plan has one)."""
        template = self.plan.template
        if template is not None:
            return template.header
        return self.plan.signature.encode(self.group.size)

    def _post_headers(self) -> None:
        g = self.group
        size = Signature.size(g.size)
        own = self._own_header()
        sends = self._foldable(send=True)
        named = self._named_reads(send=True)
        self._named_from, self._readers = self._named_reads(send=False), list(named)
        offered = [t for pieces in named.values() for t in pieces]
        self._named = {id(t) for t in offered}
        self._named.update(id(t) for pieces in self._named_from.values() for t in pieces)
        if offered:
            g.offer_to_readers([t.buffer for t in offered], self._tag(g.rank, 0, True))
        # CUDA: a peer's header is received into page-locked memory only if its data will be
        # copied H2D from there (the receives this rank's sizes fold).
        pinned_from = set(self._foldable(send=False)) if self.on_cuda else set()
        if sends and self.on_cuda:
            self._take_streams()
        if self.plan.ipc:
            from freescale_comm.ipc import Export

            by_peer: dict[int, list[Any]] = {}
            ipc_peers = self.plan.ipc_peers
            for transfer in self.plan.transfers:
                if transfer.send and transfer.peer in ipc_peers:
                    by_peer.setdefault(transfer.peer, []).append(transfer.buffer)
            self._ipc = g.ipc(self.plan.cuda_index)
            self._export = Export(self._ipc, self.seq, self._ready, by_peer)
            self._ipc.started(self.seq)  # only once nothing can raise before it is in flight
        # Room for any peer's folded data, whatever this rank expects: a peer folds by its own
        # sizes and device before anyone knows whether they agree, and a receive buffer that is
        # too small fails in UCX instead of reaching the verdict.
        room = size + g.eager_per_peer
        self._headers = [None] * g.size
        self._headers[g.rank] = own
        boxed = g.outboxes is not None
        if boxed:
            self._outbox_seq = g.next_outbox_seq()
            self._outbox_msgs = []
        unloaded: list[tuple[int, Any]] = []  # (peer, header) waiting for its D2H copies
        copies: list[tuple[np.ndarray, torch.Tensor]] = []
        # Without validation only IPC peers exchange headers (for the descriptors): the pair
        # agrees, and a peer IPC does not reach posts none.
        every_peer = g.options.validate or not self._ipc_partial
        ipc_peers = self.plan.ipc_peers
        for step in range(1, g.size):
            dst, src = (g.rank + step) % g.size, (g.rank - step) % g.size
            # The send first: the peer's data leaves before this rank's receive is posted.
            if self._export is not None and dst in ipc_peers:
                self._send_header(dst, [own, self._export.descriptor(dst)])
            elif not every_peer:
                pass  # a peer IPC does not reach, without validation: no header
            elif dst in named:
                addresses = named_reads.addresses([t.buffer for t in named[dst]])
                self._send_header(dst, [own, addresses])
            elif dst not in sends:
                self._send_header(dst, [own])
            else:
                pieces = sends[dst]
                self._folded.update(id(t) for t in pieces)
                if self.on_cuda:
                    unloaded.append((dst, self._load_header(own, pieces, copies)))
                else:
                    self._send_header(dst, [own, *(t.buffer for t in pieces)])
            if not (every_peer or src in ipc_peers):
                continue
            if boxed and g.reaches_by_outbox(src):
                self._outbox_from[src] = src in pinned_from
            else:
                self._headers[src] = self._header_buffer(room, src in pinned_from)
                self._post(Transfer(src, self._headers[src], 0, send=False))
        if unloaded:
            event = self._cuda.copy(self._streams.d2h, copies, self._cuda.d2h_watch)
            self._unloaded_headers = (event, unloaded)
        else:
            self._write_outbox()
            if (not self.on_cuda or self.ring_cuda) and not self.plan.forwarding:
                self._post_early()  # (IPC plans are on CUDA, never ring_cuda: nothing to send)

    def _send_header(self, peer: int, parts: list[Any]) -> None:
        """Sends ``peer`` this rank's header message (``parts`` in order): into this rank's
        outbox where the group has them (written with the others, ``_write_outbox``), else one
        message."""
        if self._outbox_msgs is not None and self.group.reaches_by_outbox(peer):
            self._outbox_msgs.append((peer, parts))
        else:
            message = parts[0] if len(parts) == 1 else np.concatenate(parts)
            self._post(Transfer(peer, message, 0, send=True))

    def _write_outbox(self) -> bool:
        """Writes and publishes this rank's header messages, once its outbox may take them
        (``Outboxes.writable``), also none at all (the number is taken); True if it did."""
        if self._outbox_msgs is None or self._unloaded_headers is not None:
            return False
        boxes = self.group.outboxes
        if not boxes.writable(self._outbox_seq):
            return False
        boxes.write(self._outbox_seq, self._outbox_msgs)
        self._outbox_msgs = None
        return True

    def _read_outboxes(self) -> bool:
        """Takes the header messages of the peers whose outboxes have them (a view in place,
        or a page-locked copy where folded CUDA data is copied H2D from it); True if any."""
        boxes = self.group.outboxes
        seq = self._outbox_seq
        arrived = [peer for peer in self._outbox_from if boxes.arrived(peer, seq)]
        for peer in arrived:
            message = boxes.read(peer, seq)
            if self._outbox_from.pop(peer):
                pinned = self._header_buffer(len(message), True)
                pinned[:] = message
                message = pinned
            self._headers[peer] = message
        return bool(arrived)

    def _release_outboxes(self) -> None:
        """This rank is done with the peers' outboxes of this collective (headers judged,
        folded data copied out, or the collective failed)."""
        if self._outbox_seq and not self._outbox_released:
            self._outbox_released = True
            boxes = self.group.outboxes
            if boxes is not None:
                boxes.release(self._outbox_seq)

    def _post_early(self) -> None:
        """Posts with the headers the sends that take a shared-memory ring and are not folded:
        a medium message then costs one round trip, not two. It waits in the receiver's ring
        and reaches the output only once the receiver has judged every header consistent (a
        receive into the output is posted only then); after a bad verdict the receivers
        discard it. On the staging rings (CUDA) every send leaves early: its D2H copy waits on
        the GPU for the caller's stream. Host data leaves early only if no earlier collective
        may still send data behind it (``GroupContext.holds_back_early_sends``)."""
        g = self.group
        early = [
            t
            for t in self.plan.transfers
            if t.send
            and id(t) not in self._folded
            and (self.ring_cuda or g.sends_early(t.peer, len(t.buffer)))
        ]
        if not early or (not self.on_cuda and g.holds_back_early_sends(self.seq)):
            return
        for transfer in early:
            self._post(transfer)
            self._early.add(id(transfer))

    def _header_buffer(self, size: int, pinned: bool) -> np.ndarray:
        """A receive buffer for a peer's header, page-locked if folded data will be copied H2D
        from it."""
        if not pinned:
            return np.empty(size, dtype=np.uint8)
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self._pinned.append(pinned)
        return pinned.numpy()

    def _load_header(
        self,
        own: np.ndarray,
        pieces: list[Transfer],
        copies: list[tuple[np.ndarray, torch.Tensor]],
    ) -> np.ndarray:
        """A page-locked header message for one peer; appends to ``copies`` the D2H copies of
        its device pieces into it (queued by the caller behind the caller's stream)."""
        pinned = torch.empty(
            len(own) + sum(len(t.buffer) for t in pieces), dtype=torch.uint8, pin_memory=True
        )
        self._pinned.append(pinned)
        message = pinned.numpy()
        message[: len(own)] = own
        offset = len(own)
        for transfer in pieces:
            end = offset + len(transfer.buffer)
            copies.append((message[offset:end], transfer.buffer))
            offset = end
        return message

    def _post_loaded_headers(self) -> bool:
        """Posts the headers whose folded CUDA data has reached host memory."""
        event, unloaded = self._unloaded_headers
        if not event.query():
            return False
        self._unloaded_headers = None
        for peer, message in unloaded:
            self._send_header(peer, [message])
        self._write_outbox()
        self.group.transport.progress()
        return True

    def _may_fold(self) -> bool:
        """Whether this plan's data may travel in headers (no ring forwarding; not on the
        staging rings, whose data leaves with the headers without a CPU wait for its D2H; on
        the IPC path, whose headers carry where the data lies, only to the peers it does not
        reach)."""
        plan = self.plan
        return (
            self.group.eager_per_peer > 0
            and not plan.forwarding
            and not self.ring_cuda
            and (not plan.ipc or (self.group.options.validate and self._ipc_partial))
        )

    def _foldable(self, send: bool) -> dict[int, list[Transfer]]:
        """Per peer, the sends (or receives) whose bytes fit in its header, in message order.

        Sender and receiver pick the same pieces once the verdict found the sizes consistent:
        both decide from the same per-pair byte count of the signature.
        """
        if not self._may_fold():
            return {}
        return self._kept(("fold", send), lambda: self._pick_foldable(send))

    def _kept(
        self, key: tuple[str, bool], pick: Callable[[], dict[int, list[Transfer]]]
    ) -> dict[int, list[Transfer]]:
        """``pick()``'s transfers per peer, kept by index with the plan's template under
        ``key`` (the same pieces as for the call that made the template)."""
        plan = self.plan
        template = plan.template
        if template is None:
            return pick()
        indices = template.derived.get(key)
        if indices is None:
            indices = template.derived[key] = {
                peer: [plan.transfers.index(t) for t in pieces] for peer, pieces in pick().items()
            }
        transfers = plan.transfers
        return {peer: [transfers[i] for i in idx] for peer, idx in indices.items()}

    def _folded_receives(self, size: int) -> Iterator[tuple[int, Transfer, int, int]]:
        """Each receive folded into a peer's header: (peer, the receive, where its bytes start
        and end in that header, whose signature takes ``size`` bytes)."""
        for peer, pieces in self._foldable(send=False).items():
            offset = size
            for transfer in pieces:
                end = offset + len(transfer.buffer)
                yield peer, transfer, offset, end
                offset = end

    def _pick_foldable(self, send: bool) -> dict[int, list[Transfer]]:
        signature = self.plan.signature
        totals = signature.send_bytes if send else signature.recv_bytes
        by_peer: dict[int, list[Transfer]] = {}
        ipc_peers = self.plan.ipc_peers
        fold_limit, on_cuda = self.group.fold_limit, self.on_cuda
        for transfer in self.plan.transfers:  # a plan lists each peer's messages in tag order
            if (
                transfer.send == send
                and totals[transfer.peer] <= fold_limit(transfer.peer, on_cuda)
                and transfer.peer not in ipc_peers
            ):
                by_peer.setdefault(transfer.peer, []).append(transfer)
        return by_peer

    def _post(self, transfer: Transfer) -> None:
        request = transfer.request = self._message(
            transfer.peer, transfer.buffer, transfer.sub, transfer.send
        )
        if getattr(request, "by_read", False):
            # The peer reads it from this process's memory, maybe after the group is gone;
            # the plan cache's byte views hold only an address.
            request.keep = self.plan.keep
        self._posted.append(transfer)

    def _message(self, peer: int, buffer: Any, sub: int, send: bool) -> Any:
        """Posts one tagged send to / receive from ``peer``; returns the request. Staged
        CUDA bytes of a peer on the staging rings go there, ordered after the caller's
        stream."""
        g = self.group
        tag = self._tag(peer, sub, send)
        ring = (
            self.plan.staged
            and isinstance(buffer, torch.Tensor)
            and buffer.is_cuda
            and g.stages_on_rings(peer)
        )
        return g.post(peer, buffer, tag, send, sub, self._ready if ring else None)

    def _pipeline_message(self, peer: int, buffer: np.ndarray, sub: int, send: bool) -> Any:
        """Posts one host chunk of the staged pipeline, on UCX even to a peer of this host: the
        pipeline posts a window of receives in its own order, so a ring, which delivers in the
        order sent, could hold the next chunk behind one whose receive is not posted yet (a
        ring AllGather's own chunk before the forward the window waits for: a deadlock)."""
        return self.group.post_ucx(peer, buffer, self._tag(peer, sub, send), send)

    def _tag(self, peer: int, sub: int, send: bool) -> int:
        """The tag of this collective's message ``sub`` to or from ``peer`` (the sender's)."""
        g = self.group
        return make_tag(g.group_id, self.seq, g.rank if send else peer, sub)

    # ----------------------------------------------------------------- engine thread
    def advance(self) -> bool:
        """Polls this collective's requests and moves it forward; True if anything changed."""
        try:
            with self._lock:
                return self._advance_locked()
        finally:
            self._flush_abort()

    def _advance_locked(self) -> bool:
        if self.finished:
            return False
        progressed = self._poll()
        if self.finished:
            return True
        if self._ipc_gated is not None:
            progressed |= self._advance_gated()
            if self.finished:
                return True
        if self._phase == "header" and self._unloaded_headers is not None:
            progressed |= self._post_loaded_headers()
        if self._phase == "header" and self._outbox_seq:
            if self._outbox_msgs is not None:
                progressed |= self._write_outbox()
            if self._outbox_from:
                progressed |= self._read_outboxes()
        if (
            self._phase == "header"
            and self._unloaded_headers is None
            and self._outbox_msgs is None
            and not self._outbox_from
            and not (self._posted and any(t.sub == 0 for t in self._posted))
        ):
            self._judge()
            progressed = True
        if self._phase == "diagnose" and not any(t.sub == 0 for t in self._posted):
            problem = judge_table(self._headers, self.group.size)
            self._reject(problem or "the signature digests disagree, the tables do not")
            progressed = True
        if (
            self._phase == "ready"
            and self.plan.direct_peers
            and self._ipc_done is None
            and self._ipc_gated is None
            and self._ipc.ready(self.seq)
        ):
            # The IPC part waits for the caller's stream on the GPU: queued at once; only the
            # UCX device messages wait for that stream on the CPU (``_start_data``).
            self._start_ipc()
            progressed = True
            if self.finished:
                return True
        if self._phase == "ready" and (
            (self._ipc is None or self._ipc_done is not None or self._ipc.ready(self.seq))
            and (self._ready is None or self.plan.gpu_ordered or self._ready.query())
            # A ring delivers in order and holds data whose receive is not posted: this one's
            # host data would sit ahead of an earlier one's forwards, which a peer still in
            # that earlier collective waits for. With headers the verdict comes only once the
            # peers have started this one, after the earlier one's receives. (CUDA data is not
            # held back, as in ``_post_early``: a CUDA collective may post until it is sealed.)
            and not (
                self._unheaded and not self.on_cuda and self.group.holds_back_early_sends(self.seq)
            )
        ):
            self._start_data()
            progressed = True
            if self.finished:
                return True
        if self._phase == "data":
            progressed |= self._post_forwards()
            if self._pipeline is not None:
                progressed |= self._advance_pipeline()
                if self.finished:
                    return True
            if (
                not self._posted
                and not self._unposted
                and self._ipc_gated is None
                and (self._pipeline is None or self._pipeline.sealable)
                and self._local_copies_done()
                and self._named_reads_ended()
                and self._read_by_peers()
            ):
                progressed |= self._complete()
        if self._phase == "sealed":
            if self._pipeline is not None:
                progressed |= self._advance_pipeline()  # last sends; slots given back
                if self.finished:
                    return True
            if self.final.query() and (self._pipeline is None or self._pipeline.finished):
                self._finish()
                progressed = True
        return progressed

    def _advance_pipeline(self) -> bool:
        try:
            return self._pipeline.advance()
        except FreescaleError as err:  # a UCX error on a staged message
            self._fail_locked(str(err), "peer")
            return True

    def _poll(self) -> bool:
        done = [t for t in self._posted if t.request.completed]
        if not done:
            return False
        for transfer in done:
            try:
                transfer.request.check_error()
            except Exception as err:
                way = "sending to" if transfer.send else "receiving from"
                self._fail_locked(f"transport error {way} rank {transfer.peer}: {err}", "peer")
                return True
            if self.on_cuda:
                last = getattr(transfer.request, "last", None)  # a staging ring's H2D copies
                if last is not None:
                    self._ring_events.append(last)
            transfer.done = True
            transfer.request = None
        self._posted = [t for t in self._posted if not t.done]
        return True

    def _judge(self) -> None:
        g = self.group
        size = Signature.size(g.size)
        # Without validation IPC headers are exchanged for their descriptors only.
        problem = self._verdict(self._headers, size) if g.options.validate else None
        if problem:  # the slots peers pushed into are freed unread; the headers go next
            self._pushed_slots = self._slots_pushed_here(size)
        if problem is NEEDS_TABLE:
            self._diagnose()
            return
        if problem:
            self._reject(problem)
            return
        if self.plan.ipc:
            try:
                self._read_descriptors(size)
            except FreescaleError as err:
                # Only this rank can see it: the group is aborted, so every rank stops at once
                # (the others would queue the collective and wait for this rank's flags).
                self._headers = []
                self._fail_locked(f"CUDA IPC: {err}", "peer")
                return
        for peer, transfer, lo, hi in self._folded_receives(size):
            if self.on_cuda:  # queued H2D with the data phase
                self._folded_loads.append((transfer.buffer, self._headers[peer][lo:hi]))
            else:
                transfer.buffer[:] = self._headers[peer][lo:hi]
            self._folded.add(id(transfer))
        if self._named:
            if not self._name_reads(size):
                return
        else:
            self._release_outboxes()
        self._headers = []
        self._phase = "ready"

    def _name_reads(self, size: int) -> bool:
        """Takes the addresses of the pieces this rank reads from the peers' headers (the
        outboxes stay held until they are read); False if a header names too few (the
        collective failed)."""
        g = self.group
        self._reads_named = True  # the peers judged alike and read this rank's pieces now
        for peer, transfers in self._named_from.items():
            found = named_reads.decode(self._headers[peer], size, len(transfers))
            if found is None:
                self._headers = []
                self._fail_locked(f"rank {peer}'s header names no address of its pieces", "peer")
                return False
            channel = g.reader_of(peer)
            self._named_receives += [
                (peer, channel, remote, t.buffer)
                for remote, t in zip(found, transfers, strict=True)
            ]
        if not self._named_receives:  # nothing to read here: the peers' outboxes are done with
            self._release_outboxes()
        return True

    def _verdict(self, headers: list[Any], size: int) -> str | object | None:
        """``judge``'s verdict on the table of ``headers`` (their first ``size`` bytes). A table
        judged consistent for this call shape before is consistent now: compared as bytes (up
        to ``_GOOD_TABLES`` of them per template), not judged again."""
        template = self.plan.template
        if template is None:
            return judge([h[:size] for h in headers], self.group.size)
        table = b"".join([h[:size].tobytes() for h in headers])
        good = template.derived.setdefault("good", set())
        if table in good:
            return None
        problem = judge([h[:size] for h in headers], self.group.size)
        if problem is None and len(good) < _GOOD_TABLES:
            good.add(table)
        return problem

    def _slots_pushed_here(self, size: int) -> dict[int, int]:
        """The slots of this rank's mailbox that the peers' pieces of this collective were
        pushed into, by peer (``_reject`` frees them unread). Read from every peer of the host
        whose header names the IPC path, whatever this rank's own call: a rank that passes CPU
        tensors where its peers pass CUDA ones fails the verdict with them, and a slot left
        unfreed would hold the sender's next push to it until the group timeout."""
        from freescale_comm.ipc import pushed_slot

        g = self.group
        if g.mailbox_path() is None:
            return {}  # no IPC collective yet: no peer knows this rank's mailbox
        slots = {}
        for peer in g.ipc_peers:
            header = self._headers[peer]
            if header is not None and names_ipc(header):
                slot = pushed_slot(header[size:])
                if slot >= 0:
                    slots[peer] = slot
        return slots

    def _read_descriptors(self, size: int) -> None:
        """IPC: where each peer's pieces for this rank lie (after the signature in its header),
        paired with this rank's receive buffers in message order."""
        from freescale_comm.ipc import MAILBOX_SLOT_BYTES, MAILBOX_SLOTS, decode, slot_offset

        receives: dict[int, list[Any]] = {}
        for transfer in self.plan.transfers:
            if not transfer.send:
                receives.setdefault(transfer.peer, []).append(transfer.buffer)
        path = self._ipc
        for step in range(1, self.group.size):  # ring order spreads who reads whom at once
            peer = (self.group.rank - step) % self.group.size
            if peer not in self.plan.ipc_peers:
                continue
            buffers = receives.get(peer, [])
            descriptor = decode(self._headers[peer][size:], len(buffers))
            path.shares_gpu |= descriptor.gpu == path.gpu
            path.learn_mailbox(peer, descriptor.mailbox)
            pieces = descriptor.pieces
            for buffer, piece in zip(buffers, pieces, strict=True):
                if piece.nbytes != len(buffer):  # validate=False lets mismatched sizes through
                    raise FreescaleError(
                        f"rank {peer} sends {piece.nbytes} bytes into a {len(buffer)}-byte receive"
                    )
            if descriptor.slot >= 0:
                start = slot_offset(path.host_index(peer), descriptor.slot)
                if descriptor.slot >= MAILBOX_SLOTS or any(
                    p.offset < start or p.offset + p.nbytes > start + MAILBOX_SLOT_BYTES
                    for p in pieces
                ):
                    raise FreescaleError(f"rank {peer} names bytes outside its mailbox slot")
                self._pushed_in[peer] = (descriptor.slot, list(zip(buffers, pieces, strict=True)))
            elif buffers:
                self._pulls[peer] = list(zip(buffers, pieces, strict=True))

    def _diagnose(self) -> None:
        """The size digests disagree: every rank sends every peer its whole row of the size
        table (tagged like the header, whose receive is done), and every rank names the first
        problem from the same table (``validation.judge_table``)."""
        g = self.group
        own = self.plan.signature.encode_table(g.size)
        self._release_outboxes()
        self._phase = "diagnose"
        g.unstall_early(self.seq)  # the tables travel behind the peers' early data
        self._headers = [None] * g.size
        self._headers[g.rank] = own
        for step in range(1, g.size):
            dst, src = (g.rank + step) % g.size, (g.rank - step) % g.size
            self._post(Transfer(dst, own, 0, send=True))
            self._headers[src] = np.empty(len(own), dtype=np.uint8)
            self._post(Transfer(src, self._headers[src], 0, send=False))
        g.transport.progress()

    def _reject(self, problem: str) -> None:
        """Fails the collective on a bad verdict, the same one on every rank."""
        g = self.group
        self._headers = []
        self._release_outboxes()
        # Peers may have sent this collective's data early: it must never reach a later
        # receive, and this rank's own early sends may still be reading its inputs.
        g.discard_early(self.seq)
        if self._early and any(t.send for t in self._posted):
            g.keep_alive(self.plan, self._pinned)
        if self._pushed_slots:
            if self._ipc is not None:  # queued by ``done_with``, which ``_fail_locked`` calls
                self._ipc.free_slots(self.seq, self._pushed_slots)
            else:  # a call off the IPC path: the slots of the path the peers push into
                path = self.group.mailbox_path()
                path.free_slots(self.seq, self._pushed_slots)
                path.done_with(self.seq, None)
        problem = with_own_error(problem, g.rank, self.plan.signature.error)
        self._fail_locked(problem, "validation")

    def _start_data(self) -> None:
        g = self.group
        self._phase = "data"
        if self.plan.ipc and self._ipc_done is None and self._ipc_gated is None:
            self._start_ipc()
            if self._phase != "data" or self.finished:  # sealed (IPC reaches every peer), failed
                return
        if self._ipc_gated is not None and not self._ipc_partial:  # sealed once it is through
            return
        folded, early, ipc_peers = self._folded | self._named, self._early, self.plan.ipc_peers
        unfolded = [
            t
            for t in self.plan.transfers
            if id(t) not in folded and id(t) not in early and t.peer not in ipc_peers
        ]
        posted = self._start_cuda_data(unfolded) if self.on_cuda else unfolded
        for transfer in posted:
            if transfer.after is None:
                self._post(transfer)
            else:
                self._unposted.append(transfer)
        self._data_posted = True
        # After posting: peers pull this rank's pieces while it copies its own. Helpers start
        # before the progress below, which may read a peer's message on this thread.
        own = self.plan.local_copies if not self.on_cuda else []
        on_helpers = g.local_copies.on_helpers(own)
        if on_helpers:
            self._local_pending = g.local_copies.start(own)
        if posted or self.on_cuda:  # a receive posted after its rendezvous arrived needs one
            g.transport.progress()
        if self._named_receives:
            self._reading = named_reads.PendingReads(
                self._named_receives, g.local_copies.threads, g.transport.wake
            )
            self._named_receives = []
            # Read here (one reader thread): the peers learn it before this rank's own copy.
            self._named_reads_ended()
            if self.finished:
                return
        if not on_helpers:
            host_copies(own)

    def _start_cuda_data(self, unfolded: list[Transfer]) -> list[Transfer]:
        """Queues the local copies and the H2D copies of folded data; returns the messages to
        post as they are (direct path, staging rings), the staged pipeline takes the rest."""
        from freescale_comm.staged import StagedPipeline

        cuda = self._cuda
        streams = self._streams or self._take_streams()
        if self.plan.local_copies and not self.plan.ipc:  # IPC: queued with its copies
            self._local_done = cuda.copy(streams.d2h, self.plan.local_copies)
        if self._folded_loads:
            self._folded_done = cuda.copy(streams.h2d, self._folded_loads)
            self._folded_loads = []
        if not self.plan.staged:
            return unfolded
        g = self.group
        # A ring forward stays in the pipeline: it is sent from the host slot it arrived in.
        forwarding = self.plan.forwarding
        ringed = [t for t in unfolded if not forwarding and g.stages_on_rings(t.peer)]
        if len(ringed) == len(unfolded):
            return unfolded
        ids = {id(t) for t in ringed}
        self._pipeline = StagedPipeline(
            self.plan,
            cuda,
            streams,
            self._pipeline_message,
            g.options.chunk_bytes,
            [t for t in unfolded if id(t) not in ids],
        )
        return ringed

    def _start_ipc(self) -> None:
        """Queues the collective's IPC part on the group's IPC stream (``ipc``), and seals the
        collective if IPC reaches every peer; the peers it does not reach are left to the
        other paths, and the collective's last copies wait for the IPC part."""
        path = self._ipc
        try:
            gated = path.enqueue(
                self.seq,
                self._ready,
                self._export,
                self._pushed_in,
                self._pulls,
                self.plan.local_copies,
            )
        except FreescaleError as err:  # e.g. a peer's memory that cannot be mapped here
            self._fail_locked(f"CUDA IPC: {err}", "peer")
            return
        self._pulls, self._pushed_in = {}, {}
        if gated is not None:
            self._ipc_gated = gated
            self._advance_gated()
            return
        self._end_ipc()

    def _advance_gated(self) -> bool:
        """Moves the pulls gated on the CPU (``ipc.GatedPulls``); once they are through, queues
        the IPC part's end. True if anything changed."""
        gated, path = self._ipc_gated, self._ipc
        pulls, readers = len(gated.pulls), len(gated.readers)
        try:
            through = path.advance(gated)
        except FreescaleError as err:
            self._fail_locked(f"CUDA IPC: {err}", "peer")
            return True
        if through:
            self._ipc_gated = None
            self._end_ipc()
            return True
        if not gated.watched:
            path.watch(gated, lambda: self.finished)
        return (pulls, readers) != (len(gated.pulls), len(gated.readers))

    def _end_ipc(self) -> None:
        """Records the end of the queued IPC part (with peers on other hosts) or seals the
        collective behind it, and lets the next IPC collective be queued."""
        path = self._ipc
        stream = path.stream
        if self._ipc_partial:
            # Blocking-sync: the IPC path may hand it to a watcher thread (``IpcPath.ready``),
            # which would otherwise spin on a core until it completes.
            self._ipc_done = torch.cuda.Event(blocking=True)
            self._ipc_done.record(stream)
            path.done_with(self.seq, self._ipc_done)
            return
        self._seal(stream, self._cuda.h2d_watch)
        path.done_with(self.seq, self.final)

    def _take_streams(self) -> CopyStreams:
        """This collective's copy streams, ordered after the caller's stream on the GPU: inputs
        are read, and outputs written, only once the work queued before the call is done."""
        streams = self._streams = self._cuda.streams()
        streams.d2h.wait_event(self._ready)
        streams.h2d.wait_event(self._ready)
        return streams

    def _post_forwards(self) -> bool:
        ready = [t for t in self._unposted if t.after is not None and t.after.done]
        if not ready:
            return False
        for transfer in ready:
            self._post(transfer)
        self._unposted = [t for t in self._unposted if t.request is None and not t.done]
        self.group.transport.progress()
        return True

    def _local_copies_done(self) -> bool:
        """Whether the own pieces' copies on helper threads are done (a failed one fails the
        collective: its output is incomplete)."""
        pending = self._local_pending
        if pending is None:
            return True
        if not pending.done():
            return False
        self._local_pending = None
        error = pending.error()
        if error is not None:
            self._fail_locked(error, "raised")
            return False
        return True

    def _named_reads_ended(self) -> bool:
        """Whether this rank's reads of its peers' pieces (``named_reads``) have ended; once
        they have, the peers' outboxes of this collective are released (a failed read fails
        the collective)."""
        reading = self._reading
        if reading is None:
            return True
        if not reading.done():
            return False
        self._reading = None
        failed = reading.failure()
        if failed is not None:
            self._fail_locked(failed, "peer")
            return False
        self._release_outboxes()
        return True

    def _read_by_peers(self) -> bool:
        """Whether every peer that reads this rank's pieces at the addresses its header names
        has read them (released this collective's outbox)."""
        return not self._readers or self.group.outboxes.reads_done(self._outbox_seq, self._readers)

    def _named_reads(self, send: bool) -> dict[int, list[Transfer]]:
        """Per peer, the sends (or receives) its receiver reads at the addresses the sender's
        header names (``GroupContext.reads_named``), in message order. Sender and receiver pick
        the same pieces once the verdict found the sizes consistent: both decide by each
        piece's size."""
        if self.on_cuda or self.plan.forwarding:
            return {}
        return self._kept(("named", send), lambda: self._pick_named(send))

    def _pick_named(self, send: bool) -> dict[int, list[Transfer]]:
        folded = self._foldable(send)
        reads_named = self.group.reads_named
        by_peer: dict[int, list[Transfer]] = {}
        for transfer in self.plan.transfers:
            peer = transfer.peer
            if (
                transfer.send == send
                and peer not in folded
                and reads_named(peer, len(transfer.buffer), send)
            ):
                by_peer.setdefault(peer, []).append(transfer)
        return by_peer

    def _complete(self) -> bool:
        """Every message of the collective is done (a staged pipeline's copies queued)."""
        if self.on_cuda:
            if self._pipeline is not None:
                self._seal(self._streams.h2d, self._cuda.h2d_watch)
            else:
                self._seal(self._streams.d2h, self._cuda.d2h_watch)
            return True
        with torch.no_grad():  # into the output's memory, as the own bytes went: not autograd's
            for dst, src in self.plan.copy_back:
                dst.copy_(src)
        self._finish()
        return True

    def _seal(self, stream: torch.cuda.Stream, watcher: Any) -> None:
        """Enqueues the CUDA collective's last copies and its end event on ``stream``, behind
        every part of it (local copies, IPC, folded data, the pipeline, the rings)."""
        cuda = self._cuda
        for event in (
            self._local_done,
            self._ipc_done,
            self._folded_done,
            self._pipeline and self._pipeline.last_d2h,
            *self._ring_events,
        ):
            if event is not None:
                stream.wait_event(event)
        if self.plan.copy_back:
            with torch.cuda.stream(stream), torch.no_grad():
                for dst, src in self.plan.copy_back:
                    dst.copy_(src, non_blocking=True)  # strided outputs: a copy kernel
        self.final = torch.cuda.Event(blocking=True)
        self.final.record(stream)
        if self._pipeline is not None:
            watcher.watch(self.final)  # wakes the engine thread, which finishes the pipeline
        else:
            # Nothing but the end event is left, and a caller that drove the collective here
            # hands nothing to the engine (whose thread, busy with it, would refuse the
            # caller's next collective its claim). Unless somebody waits for the end, it is
            # found by a poll (the group's next call, the deadline watch): a watcher thread
            # woken per collective took the GIL from the caller's next call.
            with self._future_lock:
                self._final_watcher = watcher
                prompt = self._prompt
            if prompt:
                watcher.watch(self.final, self._finish_after_final)
        if self._streams is not None:  # IPC alone takes none
            cuda.release_streams(self._streams)
        self._phase = "sealed"
        self.sealed.set()

    @property
    def may_post_host_data(self) -> bool:
        """Whether this collective may still post data to the host rings: a later one's data
        must not go ahead of it there (``GroupContext.holds_back_early_sends``). A CUDA one
        may until it is sealed (staged chunks, headers posted once their D2H is done)."""
        if self.finished:
            return False
        if self.on_cuda:
            return self._phase != "sealed"
        return not self._data_posted or bool(self._unposted)

    @property
    def queued_behind(self) -> bool:
        """Whether nothing can move this collective until an earlier one of its group has
        written its headers: its own go into the outboxes in call order (``Outboxes.writable``)
        and it sends nothing else before. The engine passes over it then: with many in flight,
        advancing each on every pass made their cost grow with their square. (Read without the
        lock: a stale answer only moves it to the next pass.)"""
        boxes = self.group.outboxes
        return (
            self._phase == "header"
            and self._outbox_msgs is not None
            and self._unloaded_headers is None
            and boxes is not None
            and self._outbox_seq > boxes.posted + 1
        )

    @property
    def uses_transport(self) -> bool:
        """Whether a step must progress the transport (UCX and the rings) for it: it has
        messages posted or to post there, a staged pipeline, or CUDA work. A CPU collective
        whose headers and data all travel through the outboxes only reads their counters."""
        return bool(self._posted or self._unposted) or self.on_cuda or self._pipeline is not None

    @property
    def needs_engine(self) -> bool:
        """False once only the end event is left, which ``_finish_after_final`` awaits."""
        return not (self._phase == "sealed" and self._pipeline is None)

    def _finish_after_final(self, error: str | None) -> None:
        with self._lock:
            if self.finished:
                return
            if error is not None:
                self._fail_locked(error, "internal")
                return
            self.finished = True
        self._resolve()

    def _finish(self) -> None:
        self.finished = True
        self._resolve()

    def _resolve(self) -> None:
        """Completes a finished collective: buffers released, future and event set."""
        self._pinned = []
        self._ring_events = []
        plan = self.plan
        self._set_outcome(True, plan.result if plan.value is None else plan.value)
        self.event.set()
        self.group.retire(self)

    def expire(self) -> None:
        """Fails the collective because the group's timeout passed, naming who is missing."""
        try:
            with self._lock:
                self._expire_locked()
        finally:
            self._flush_abort()

    def _expire_locked(self) -> None:
        if self.finished:
            return
        receiving = [t for t in self._posted if not t.send]
        # A missing header: the peer has not called this collective (or called another).
        unheard = sorted({t.peer for t in receiving if t.sub == 0} | set(self._outbox_from))
        waiting = sorted({t.peer for t in receiving if t.sub != 0} - set(unheard))
        unsent = sorted({t.peer for t in self._posted + self._unposted if t.send})
        if self._pipeline is not None:
            waiting, unsent = self._pipeline.waiting_peers()
        parts = [f"did not finish within {self.timeout_s:g} s"]
        if unheard:
            # Sub 0 carries the header, or after a bad digest the size tables (``_diagnose``).
            what = "size table" if self._phase == "diagnose" else "header"
            parts.append(f"no {what} yet from {self.group.describe_peers(unheard)}")
        if waiting:
            parts.append(f"no data yet from {self.group.describe_peers(waiting)}")
        if unsent:
            parts.append(f"sends to ranks {unsent} not completed")
        if self._reads_named and self._reading is None and self._readers:
            boxes = self.group.outboxes
            unread = [p for p in self._readers if not boxes.reads_done(self._outbox_seq, [p])]
            if unread:
                parts.append(f"{self.group.describe_peers(unread)} did not read its pieces")
        if self._ipc_gated is not None:
            peers = self.group.describe_peers(self._ipc_gated.waiting_for)
            parts.append(f"its CUDA IPC copies wait for the flags of {peers}")
        elif self._phase == "ready" or self._unloaded_headers is not None:
            parts.append("the CUDA work queued before the call has not finished")
        if self._phase == "sealed":
            parts.append("its last CUDA copies have not finished")
        self._fail_locked("; ".join(parts), "timeout")

    def fail(self, reason: str, kind: str) -> None:
        """Fails the collective (no-op once finished); ``kind`` picks the exception type."""
        try:
            with self._lock:
                self._fail_locked(reason, kind)
        finally:
            self._flush_abort()

    def _flush_abort(self) -> None:
        # Outside the lock: aborting the group fails its other collectives, which lock too.
        reason, self._abort_reason = self._abort_reason, None
        if reason is not None:
            self.group.abort(reason)

    def _fail_locked(self, reason: str, kind: str) -> None:
        if self.finished:
            return
        if self._local_pending is not None:
            # The caller may reuse the outputs once it sees the failure: no helper writes
            # them after that (a memcpy: bounded).
            self._local_pending.wait()
            self._local_pending = None
        if self._reading is not None:  # the same for reads into the outputs
            self._reading.wait()
            self._reading = None
        self.error = _ERRORS[kind](f"{self.label}: {reason}")  # first: seen with ``finished``
        self.finished = True
        self._headers = []
        if not self._reads_named:
            # Once reads are named, a release would let the peers complete, and one still
            # reading this rank's inputs, which its caller may reuse once this raises, would
            # complete with what it read. Held, the peers fail with the group's abort (every
            # failure after a good verdict aborts it).
            self._release_outboxes()
        # The buffers (and the staging slots still held) of the cancelled requests stay
        # referenced by the group.
        in_flight = [t.request for t in self._posted if t.request is not None]
        for transfer in self._posted:
            transfer.request = None
        if self._pipeline is not None:
            in_flight += self._pipeline.cancel()
        self.group.transport.cancel(in_flight)
        if kind != "validation":
            # Its receives on the rings go too: the caller may reuse their buffers now (a bad
            # verdict dropped them already, ``_reject``).
            self.group.discard_early(self.seq)
            # A verdict comes after every header request and copy completed: nothing to keep.
            self.group.keep_alive(self.plan, self._pinned)
        if self._ipc is not None:  # a later IPC collective need not wait for this one
            self._ipc_gated = None
            self._ipc.done_with(self.seq, None)
        if self._streams is not None and self._phase != "sealed":
            # Copies still queued on them stay ahead of any later user's (stream order).
            self._cuda.release_streams(self._streams)
            self._streams = None
        self._posted, self._unposted = [], []
        if kind in ("timeout", "peer", "raised"):
            self._abort_reason = f"rank {self.group.rank}: {self.error}"
        self._set_outcome(False, self.error)
        self.sealed.set()
        self.event.set()
