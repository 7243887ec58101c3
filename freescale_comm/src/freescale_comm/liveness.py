"""Liveness of one group's ranks, at a store load that grows linearly with the group.

UCX's own peer-failure detection forces TCP (3-5x slower), so it stays off and a dead peer
would leave receives waiting forever: liveness is the backend's job, through the group's c10d
store. Every rank bumps its own heartbeat counter every ``heartbeat_s`` and watches only its
``WATCHED`` successors on the ring of group ranks (rank r watches r+1 and r+2 mod N): every
``poll_s`` one ``multi_get`` reads the group's abort key and count of departures together with
those counters. A watcher that sees a counter stand still for ``dead_after_s`` writes the abort
key, naming the silent rank; every rank reads that key in its next poll, so every survivor
learns of the death within one more period. The store serves N ``add`` per ``heartbeat_s`` and
N ``multi_get`` of ``2 + WATCHED`` keys per ``poll_s``.

A rank that destroys the group appends to the left key how many of its collectives it
finished (numbered in call order, the same on every rank) and how many it ran on the group's
Gloo backend, then counts its departure (``stop``); the peers of its host also find those
numbers in its outbox (``local_departures``), without the store, whose host it may be. A peer
that sees the count change reads the left key once (``departed``): it stops watching the ranks
that left, so their silence and their processes' exits are no failure, and the group fails
any collective one of them never finished, or never ran on Gloo, at once (as Gloo's peer sees
the closed connection) instead of at the group timeout.

Peers on this host are also watched by their process (``watch_processes``): a poll that finds
one gone (exited, or a zombie; its pid reused by another process counts as gone) reports it
at once, without waiting ``dead_after_s``, as a broken connection does for Gloo. A silent peer
whose process still runs is not reported: its heartbeat is Python, which waits while another of
its threads holds the GIL in one long call (a stopped process is reported as elsewhere; a peer
that runs but never calls is the collective timeout's case, as for Gloo). Peers on other hosts
have only their heartbeats: ``dead_after_s`` must outlast any one call there that holds the GIL.

The heartbeat and the polls use a connection to the store of the group's own
(``own_connection``; the directory's address lookups share it): on the caller's, they would
wait behind a request another thread blocks in (a ``wait`` for a late peer's ``new_group``, a
checkpoint barrier). They run on a thread of the group's own (``start``): a request to a store
whose host is stopped or cut off blocks for the store's whole timeout, which must hold neither
the engine thread (it moves every group's data) nor a caller (an abort hands the abort key to
that thread, ``request_abort``); a request unanswered for ``dead_after_s`` counts as an
unreachable store (``store_silence``).

Coverage: every rank watches its first ``WATCHED`` successors on the ring that have not left,
so the live rank just before any run of dead (or stopped) ranks watches one of them: a death is
seen while any rank lives, also when the watcher of a rank dies with it (a whole host). A
watcher whose own polls were interrupted (the process was stopped, or starved of CPU) for
longer than a few periods restarts its clocks instead of blaming its neighbours for its own
silence. Polls run whether or not a collective is in flight:
the watcher of a dead rank may be idle while the others wait for that rank.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch.distributed as dist

logger = logging.getLogger(__name__)

ABORT_KEY = "abort"
# Ranks that destroyed the group and what each had done by then (``Departure``), as
# "rank:finished:gloo_calls;" records appended one per rank (``stop``), and how many records
# there are.
LEFT_KEY = "left"
LEFT_COUNT_KEY = "left_count"
WATCHED = 2
# A watcher whose consecutive polls are further apart than this many periods was itself stopped
# or starved: what it saw before the gap says nothing about its neighbours.
_GAP_PERIODS = 4
# Longest wait between retries of a store that keeps failing.
_MAX_RETRY_S = 30.0
# How long a group's shutdown waits for its liveness thread (one blocked in a store request
# is left behind: a daemon, it ends with the request or the process).
_STOP_WAIT_S = 1.0
# Bound on a connection to the store's server before a retry (``Liveness._check_store_server``).
_SERVER_CHECK_S = 1.0


class Departure(NamedTuple):
    """What a rank that destroyed the group had done by then: the group's own collectives it
    finished and the collectives it ran on the group's Gloo backend (each numbered in call
    order, the same on every rank)."""

    finished: int
    gloo_calls: int


def poll_period(dead_after_s: float) -> float:
    """Seconds between polls: three of them (seeing the last beat, seeing the silence, the
    others seeing the abort key) stay well inside the 2 s a death may take beyond
    ``dead_after_s``."""
    return min(0.5, max(0.02, dead_after_s / 10))


def watched_ranks(rank: int, size: int, count: int = WATCHED) -> list[int]:
    """The ranks ``rank`` watches: its ``count`` successors on the ring (fewer in tiny groups)."""
    return [(rank + step) % size for step in range(1, min(count, size - 1) + 1)]


def create_keys(store: Any) -> None:
    """Makes the keys every poll reads (once per group, before any rank polls): a
    ``multi_get`` of a missing key would wait for it."""
    store.set(ABORT_KEY, b"")
    store.set(LEFT_KEY, b"")
    store.set(LEFT_COUNT_KEY, b"0")


def beat_key(rank: int) -> str:
    return f"hb/{rank}"


def own_connection(store: Any) -> Any:
    """``store`` over a connection of its own (``Store.clone``: same server, same prefixes), or
    ``store`` itself where it cannot be cloned (a store implemented in Python)."""
    try:
        return store.clone()
    except (AttributeError, NotImplementedError, RuntimeError):
        return store


class Liveness:
    """One rank's heartbeat and watch in one group (see the module docstring).

    ``tick`` runs on the liveness thread (``start``) whenever ``next_due`` has passed;
    everything else only reads what the last poll found, so checking a collective's health
    costs no store request.

    Args:
        store: the group's keys (the same prefix on every rank).
        rank: this rank in the group.
        size: ranks in the group.
        heartbeat_s: period of this rank's heartbeat.
        dead_after_s: a watched rank whose counter stands still this long is reported dead.
        on_failure: called once, on the thread that ticks, with ``error()`` when a poll first
            finds a silent rank or the abort key.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        heartbeat_s: float,
        dead_after_s: float,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self._on_failure = on_failure
        self._told = False
        self.rank = rank
        self.size = size
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.poll_s = poll_period(dead_after_s)
        self.watched = watched_ranks(rank, size)
        self._own_key = beat_key(rank)
        self._keys = [ABORT_KEY, LEFT_COUNT_KEY] + [beat_key(p) for p in self.watched]
        now = time.monotonic()
        # Per watched rank: the last counter value seen and when it was first seen.
        self._seen: dict[int, tuple[bytes, float]] = {p: (b"", now) for p in self.watched}
        # Ranks that destroyed the group -> what each had done (the left key as last read);
        # replaced whole, read by other threads.
        self.departed: dict[int, Departure] = {}
        self._left_count = b"0"  # the count of departures as last read
        # The departures of this host's peers as their outboxes tell them (set by the group).
        self.local_departures: Callable[[], dict[int, Departure]] | None = None
        # The abort reasons this host's peers wrote in their outboxes (set by the group).
        self.local_aborts: Callable[[], dict[int, str]] | None = None
        # Called on this thread once ``departed`` has grown (set by the group).
        self.on_departure: Callable[[], None] | None = None
        self._leaving: Departure | None = None  # this rank's own record, written as it stops
        self._last_poll = now
        self._next_beat = now
        self._next_poll = now + self.poll_s
        self.aborted: str | None = None  # the abort key's reason, once set
        self.dead: str | None = None  # what this rank's own watch found
        self.store_error: str | None = None  # the last poll failed (cleared by the next one)
        self._store_down_since: float | None = None  # since the first of those failures
        self._store_failed_at = 0.0  # ... and the last one
        self._store_failures = 0  # store requests failed in a row
        self._store_server = _server_address(store)  # asked before a retry (``tick``)
        # Same-host peers: rank -> (pid, start time), checked in /proc every poll period, on a
        # schedule of its own: no store request, so also while the store is down.
        self._processes: dict[int, tuple[int, int]] = {}
        self._next_check = now + self.poll_s
        # An abort this rank has yet to write (asked for by another thread, or the store was
        # down): written at the next tick, or once the store answers.
        self._unwritten_abort: str | None = None
        self._asking_since: float | None = None  # a store request in flight since then
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._abort_tried = threading.Event()  # set by each attempt to write the abort key
        self._stopping = False
        self.beat()

    @property
    def next_due(self) -> float:
        # Once the abort key is read there is nothing left to poll for.
        check = self._next_check if self._processes and self.dead is None else math.inf
        return min(self._next_beat, self._next_poll if self.aborted is None else math.inf, check)

    def beat(self) -> None:
        self.store.add(self._own_key, 1)
        self._next_beat = time.monotonic() + self.heartbeat_s

    def start(self) -> None:
        """Ticks on a thread of its own from now on, until ``stop`` (module docstring)."""
        self._thread = threading.Thread(
            target=self._run, name="freescale-comm-liveness", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping:
            wait = min(self.next_due - time.monotonic(), self.poll_s)
            woken = self._wake.wait(max(0.0, wait))
            if woken:  # a wake-up after a timed-out wait stays set for the next turn
                self._wake.clear()
            now = time.monotonic()
            if self._stopping or not (woken or now >= self.next_due):
                continue
            try:
                self.tick(now)
            except Exception:  # the group must keep its liveness whatever one tick hit
                logger.exception("freescale: a liveness tick raised")
        if self._unwritten_abort is not None:  # asked for just before the stop (``abort()``)
            with contextlib.suppress(Exception):
                self.abort(self._unwritten_abort)
        elif self._leaving is not None and self.aborted is None:
            # Where the store fails, the peers on other hosts take this rank's silence for a
            # death; those of this host read its outbox.
            with contextlib.suppress(Exception):
                finished, gloo_calls = self._leaving
                record = f"{self.rank}:{finished}:{gloo_calls};"
                self.store.append(LEFT_KEY, record.encode())
                self._count_departure()

    def _count_departure(self) -> None:
        """Counts this rank's departure record (appended before): the peers read the records
        once the count changes, so an ``add`` that fails is tried again, within ``stop``'s
        wait."""
        deadline = time.monotonic() + _STOP_WAIT_S / 2
        while True:
            try:
                self.store.add(LEFT_COUNT_KEY, 1)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self, leaving: Departure | None = None) -> None:
        """Ends the thread (its group is closed) and drops ``on_failure``; an abort asked for
        is written first, or else, given ``leaving`` (this rank destroys a group that was not
        aborted), this rank's departure record (module docstring). A thread blocked in a store
        request is left behind after ``_STOP_WAIT_S``: it ends with the request."""
        self._leaving = leaving
        self.on_departure = None
        self._on_failure = None
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_STOP_WAIT_S)

    @property
    def abort_reason(self) -> str | None:
        """The abort key's reason, once read or written here, or one asked for and not yet
        written (``request_abort``): either way the group is aborted."""
        return self.aborted or self._unwritten_abort

    def request_abort(self, reason: str, wait_s: float = 0.0) -> None:
        """Has the liveness thread write the abort key (first reason wins), and waits up to
        ``wait_s`` for its attempt (not on that thread): no longer, since the store's host may
        be stopped, but the caller's process may exit right after the error it raises, and
        its peers must still learn of the abort."""
        if self.aborted is not None:
            return
        self._abort_tried.clear()
        if self._unwritten_abort is None:
            self._unwritten_abort = reason
        self._wake.set()
        thread = self._thread
        if wait_s > 0 and thread is not None and thread is not threading.current_thread():
            self._abort_tried.wait(wait_s)

    def tick(self, now: float) -> None:
        """Checks the same-host peers' processes, beats and polls as due; a store error is
        remembered, not raised."""
        self._asking_since = now  # also the abort key a process check writes
        if now >= self._next_check:
            self._next_check = now + self.poll_s
            self.check_processes()
        try:
            if self._store_failures:
                self._check_store_server()
            if self._unwritten_abort is not None:
                self.abort(self._unwritten_abort)
            asked = False
            if now >= self._next_beat:
                self.beat()
                asked = True
            if now >= self._next_poll and self.aborted is None:
                self.poll(time.monotonic())
                asked = True
            if asked:
                self.store_error = None
                self._store_down_since = None
                self._store_failures = 0
        except Exception as err:  # the store's host may be the process that died
            self.store_error = f"the c10d store is unreachable ({err})"
            if self._store_down_since is None:
                self._store_down_since = now  # when the first failed request was made
            # A request may block before it fails: the outage lasted at least until then.
            self._store_failed_at = max(now, time.monotonic())
            # A store whose host is gone fails every request, and torch logs each failure
            # with a stack trace: the retries grow apart while the failures last.
            self._store_failures += 1
            retry_at = now + min(_MAX_RETRY_S, self.poll_s * 2 ** min(self._store_failures, 16))
            # One retry just past dead_after_s of outage: the outage counts only up to a failed
            # request (``store_silence``), and the next one by the doubling could come up to
            # twice as late (15 s for 10).
            counts_at = self._store_down_since + self.dead_after_s + self.poll_s
            if now < counts_at < retry_at:
                retry_at = counts_at
            self._next_beat = max(self._next_beat, retry_at)
            self._next_poll = max(self._next_poll, retry_at)
        finally:
            self._asking_since = None
        error = self.error()
        handler = self._on_failure  # once: ``stop`` may drop it meanwhile
        if error is not None and not self._told and handler is not None:
            # Once: what nobody polls must learn of it too (GPU waits on a dead peer's flags).
            self._told = True
            # The abort key's reason as it stands (the group prefixes "aborted by" itself),
            # also where this rank wrote it, or has yet to: "rank 0: rank 1 ...", who found
            # what (not "aborted by rank 1: ..." for the rank that died).
            reason = self.aborted or self._unwritten_abort or error
            try:
                handler(reason)
            except Exception:  # the liveness thread must live on
                logger.exception("freescale: handling a failed peer raised")

    def _check_store_server(self) -> None:
        """Raises where the store's server refuses a connection: torch logs each failed
        request with a C++ stack trace, and a store whose host is gone fails every one, so a
        retry first asks the server's port, which logs nothing."""
        if self._store_server is not None:
            with socket.create_connection(self._store_server, timeout=_SERVER_CHECK_S):
                pass

    def watch_processes(self, identities: dict[int, str]) -> None:
        """Also watches the processes of these peers of this host (rank -> the identity each
        published, ``process_identity``): a poll that finds one gone reports it at once. Only
        a peer in this process's PID namespace whose process, read here, is the one it
        published (same start time) is watched; the others are left to heartbeats. Call it
        before the engine ticks this liveness."""
        self._processes = watchable_processes(identities)

    def check_processes(self) -> None:
        """Reports a same-host peer whose process is gone, unless it left the group first (its
        outbox says so, or else the left key, read only then) or aborted the group first
        (its outbox says why, which is then the failure); the abort key is written now, or
        once the store answers. Nothing is news once the group is aborted."""
        if self.dead is not None or self.aborted is not None:
            return
        gone = gone_processes(self._processes)
        if gone:
            # A peer that destroyed the group may exit before this rank's next poll reads so.
            # Its outbox, where the group has them, says so for certain (it is marked before
            # the peer can exit), without the store, which may have left with it.
            if self.local_departures is not None:
                self._note_departures(self.local_departures())
            else:
                with contextlib.suppress(Exception):  # a store that fails: the exit counts
                    self._note_departures(_parse_departures(self.store.get(LEFT_KEY)))
            gone = [p for p in gone if p not in self.departed]
        if gone and self.local_aborts is not None:
            # One that aborted the group first: its reason is the failure (the abort key may
            # have left with the store it hosted).
            told = self.local_aborts()
            reason = next((told[p] for p in gone if p in told), None)
            if reason is not None:
                self.aborted = reason
                # Written here too: the peers on other hosts may not have read it (its own
                # write may have failed), and only this host's ranks watch its process.
                with contextlib.suppress(Exception):  # kept for the next tick (``abort``)
                    self.abort(reason)
                return
        if gone:
            pids = ", ".join(str(self._processes[p][0]) for p in gone)
            self.dead = f"{self.describe(gone)}: its process on this host (pid {pids}) has exited"
            with contextlib.suppress(Exception):  # kept for the next tick (``abort``)
                self.abort(f"rank {self.rank}: {self.dead}")

    def poll(self, now: float) -> None:
        """One request (and one more after a rank left): the abort key, the count of
        departures and the watched counters (the same-host peers' processes are
        ``check_processes``'s, on a schedule of their own)."""
        watched = self.watched  # the ranks whose counters ``_keys`` reads
        values = self.store.multi_get(self._keys)
        if now - self._last_poll > _GAP_PERIODS * self.poll_s:
            self._seen = {p: (seen, now) for p, (seen, _) in self._seen.items()}
        self._last_poll = now
        self._next_poll = now + self.poll_s
        if values[0]:
            self.aborted = bytes(values[0]).decode(errors="replace")
            return
        if values[1] != self._left_count:  # some rank left: read which, once
            self._note_departures(_parse_departures(self.store.get(LEFT_KEY)))
            self._left_count = bytes(values[1])
        silent = []
        for peer, raw in zip(watched, values[2:], strict=True):
            if peer not in self._seen:
                continue  # it left the group: no longer watched
            seen, since = self._seen[peer]
            if raw != seen:
                self._seen[peer] = (bytes(raw), now)
            elif now - since > self.dead_after_s and not self._runs_on_this_host(peer):
                silent.append(peer)
        if silent and self.dead is None:
            self.dead = (
                f"{self.describe(silent)}: its process died or is stopped, or held Python's GIL "
                f"for longer than dead_after_s ({self.dead_after_s:g} s)"
            )
            self.abort(f"rank {self.rank}: {self.dead}")

    def _note_departures(self, left: dict[int, Departure]) -> None:
        """Takes up ranks that left: they are no longer watched, and the next live successors
        are watched in their place (a run of dead ranks must still follow a live watcher);
        then ``on_departure``."""
        if all(self.departed.get(rank) == record for rank, record in left.items()):
            return
        departed = {**self.departed, **left}
        self.departed = departed  # whole: other threads read it
        self._processes = {p: w for p, w in self._processes.items() if p not in departed}
        successors = watched_ranks(self.rank, self.size, self.size - 1)
        self.watched = [p for p in successors if p not in departed][:WATCHED]
        now = time.monotonic()
        self._seen = {p: self._seen.get(p, (b"", now)) for p in self.watched}
        self._keys = [ABORT_KEY, LEFT_COUNT_KEY] + [beat_key(p) for p in self.watched]
        on_departure = self.on_departure
        if on_departure is not None:
            on_departure()

    def _runs_on_this_host(self, peer: int) -> bool:
        """Whether ``peer`` is a process of this host that runs (not stopped): its silence is a
        thread holding the GIL, not a death (module docstring)."""
        watched = self._processes.get(peer)
        if watched is None:
            return False
        try:
            return process_state(watched[0]) not in (None, "T", "t")
        except OSError:
            return False  # unreadable now: heartbeats decide

    def abort(self, reason: str) -> str:
        """Writes the abort key unless a reason is there already; returns the reason that won.
        Where the store fails, raises, and the next tick writes it (the peers must learn of
        it once the store is back, not wait for their timeout)."""
        try:
            won = self.store.compare_set(ABORT_KEY, b"", reason.encode())
        except Exception:
            self._unwritten_abort = reason
            raise
        else:
            self._unwritten_abort = None
            self.aborted = bytes(won).decode(errors="replace") or reason
            return self.aborted
        finally:
            self._abort_tried.set()  # a ``request_abort`` waiting for it sees the outcome

    def error(self) -> str | None:
        """Why the group's collectives cannot finish, as far as the last poll knows, or None.
        An unreachable store is not such a reason by itself (``store_silence``)."""
        if self.dead is not None:
            return self.dead
        if self.aborted is not None:
            return f"the group was aborted by {self.aborted}"
        return None

    def store_silence(self) -> str | None:
        """Why this rank cannot tell whether its peers live, where the store has failed every
        request for longer than ``dead_after_s`` or left one unanswered that long (its host
        stopped, or cut off), or None. Its host may have finished its part of the job (the
        peers' collectives still move their data) or died with it: only a collective that
        waits that long as well should fail for it (``GroupContext``).

        The outage counts up to the last failed request, not to ``now``: the retries grow
        apart (up to ``_MAX_RETRY_S``), and a store that came back between two of them must
        not fail collectives until the next one finds it back."""
        asking = self._asking_since
        if asking is not None and time.monotonic() - asking > self.dead_after_s:
            return (
                f"the c10d store has not answered a request for {time.monotonic() - asking:.0f} "
                "s, so this rank cannot tell whether its peers live"
            )
        since = self._store_down_since
        if since is None:
            return None
        known = self._store_failed_at - since
        if known <= self.dead_after_s:
            return None
        return (
            f"the c10d store has been unreachable for {known:.0f} s "
            f"({self.store_error}), so this rank cannot tell whether its peers live"
        )

    def silence(self, peer: int) -> float | None:
        """Seconds the watched ``peer``'s counter has stood still (None: not watched here)."""
        entry = self._seen.get(peer)
        return None if entry is None else time.monotonic() - entry[1]

    def describe(self, peers: list[int]) -> str:
        """ "rank a" / "ranks [a, b]", plus how long each watched one has been silent where that
        is notable."""
        notes = []
        for peer in peers:
            silent = self.silence(peer)
            if silent is not None and silent > 2 * self.heartbeat_s:
                notes.append(f"rank {peer} sent no heartbeat for {silent:.1f} s")
        listed = f"rank {peers[0]}" if len(peers) == 1 else f"ranks {peers}"
        return listed + (f" ({'; '.join(notes)})" if notes else "")


def _parse_departures(record: bytes) -> dict[int, Departure]:
    """The left key's records ("rank:finished:gloo_calls;" each) by rank."""
    left = {}
    for entry in bytes(record).decode(errors="replace").split(";"):
        fields = entry.split(":")
        if len(fields) == 3 and all(field.isdigit() for field in fields):
            rank, finished, gloo_calls = (int(field) for field in fields)
            left[rank] = Departure(finished, gloo_calls)
    return left


def process_identity() -> str:
    """This process as the ranks of its host watch it: pid, PID namespace and start time
    (``pid/namespace/start``; empty where ``/proc`` cannot tell)."""
    try:
        namespace = os.stat("/proc/self/ns/pid")
    except OSError:
        return ""
    started = process_start_time(os.getpid())
    if started is None:
        return ""
    return f"{os.getpid()}/{namespace.st_dev}:{namespace.st_ino}/{started}"


def _stat_fields(pid: int) -> list[bytes] | None:
    """``/proc/<pid>/stat`` after the command's closing parenthesis (state first, start time
    20th), or None if the process is gone or a zombie. Raises OSError where ``/proc`` cannot
    be read for another reason (permissions, descriptors): that says nothing about it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] in (b"Z", b"X") else fields


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot: with the pid, its identity), or
    None if it is gone or a zombie (``_stat_fields``)."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])


def process_state(pid: int) -> str | None:
    """Process ``pid``'s state letter (``R``, ``S``, ``D``; ``T``/``t``: stopped), or None if it
    is gone or a zombie (``_stat_fields``)."""
    fields = _stat_fields(pid)
    return None if fields is None else fields[0].decode()


def watchable_processes(identities: dict[int, str]) -> dict[int, tuple[int, int]]:
    """Of these peers of this host (rank -> the identity each published, ``process_identity``),
    those whose process this one can watch: in its PID namespace, and read here as the one
    it published (same start time); rank -> (pid, start time)."""
    mine = process_identity().split("/")
    watched = {}
    for peer, identity in identities.items():
        parts = identity.split("/")
        if len(parts) != 3 or len(mine) != 3 or parts[1] != mine[1]:
            continue
        pid, started = int(parts[0]), int(parts[2])
        try:
            if process_start_time(pid) == started:
                watched[peer] = (pid, started)
        except OSError:
            continue
    return watched


def gone_processes(watched: dict[int, tuple[int, int]]) -> list[int]:
    """The ranks of ``watched`` (``watchable_processes``) whose process has exited (a zombie
    too, or its pid taken by another process)."""
    return [peer for peer, (pid, started) in watched.items() if _gone(pid, started)]


def _gone(pid: int, started: int) -> bool:
    try:
        return process_start_time(pid) != started
    except OSError:
        return False  # unreadable now: heartbeats decide


def root_store(store: Any) -> Any:
    """The store under every ``PrefixStore`` layer: the one all groups of the job share."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _server_address(store: Any) -> tuple[str, int] | None:
    """The host and port of the TCP server under ``store``'s prefixes, or None (another kind
    of store)."""
    root = root_store(store)
    host, port = getattr(root, "host", None), getattr(root, "port", None)
    return (host, port) if isinstance(host, str) and isinstance(port, int) else None
