"""The state of one freescale group: peers, tags, liveness and abort, shared by its collectives.

Created with the process group. Everything is agreed through the group's c10d store, which every
rank reaches, with a constant number of requests per rank (``directory``): a group id for the
tags (a counter in the root store, so overlapping groups never share one) and the ranks of this
host; a peer's UCX worker address is read when this rank first talks to it over UCX.

Liveness is the backend's own job (``liveness``): every rank beats a counter in the store and
watches two ring neighbours; a watcher that finds one silent for ``dead_after_s`` writes the
group's abort key, which every rank polls in the same request. The first rank that fails a
collective for a peer-side reason writes the abort key too, so the other ranks fail fast with
the same story instead of each waiting for its own timeout.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch.distributed as dist

from freescale_comm import directory
from freescale_comm.cpu import usable_cores
from freescale_comm.engine import Engine, alone_yields, idle_poll_s
from freescale_comm.errors import FreescaleError, FreescalePeerError, FreescaleValidationError
from freescale_comm.futures import CallbackRunner
from freescale_comm.huge_pages import huge_pages
from freescale_comm.liveness import (
    Departure,
    Liveness,
    own_connection,
    process_identity,
    root_store,
)
from freescale_comm.local_copies import INLINE_READ_BYTES, LocalCopies, helper_threads
from freescale_comm.options import EVERY_SIZE, READ_ABOVE_BYTES, FreescaleOptions
from freescale_comm.transport import MAX_GROUP_SIZE, SEQ_BITS, SUB_BITS, Transport, make_tag
from freescale_comm.validation import Signature

if TYPE_CHECKING:
    import torch

    from freescale_comm.algorithms import Plan
    from freescale_comm.collective import Collective
    from freescale_comm.cuda import CudaSupport
    from freescale_comm.host_probe import ProbeVerdict
    from freescale_comm.ipc import IpcPath

logger = logging.getLogger(__name__)

_EAGER_ROOM_BYTES = 4 << 20
# Data messages up to this size leave with the headers over the rings (``sends_early``).
_EARLY_BYTES = 1 << 20
# How long an abort waits for its key to be in the store (a healthy store takes milliseconds):
# bounded, since the store's host may be the stopped process.
_ABORT_WRITE_WAIT_S = 1.0


class _SealedDeadlines:
    """A watch (``engine.Watch``) over the group's collectives left to their CUDA end event:
    no thread drives those. It finishes those whose event has completed (nothing else may
    poll them: the group's last call before an idle spell), and fails those past their
    deadline: a peer whose GPU never meets the collective's flags would otherwise hold this
    rank's streams for ever, unreported. Each tick first runs the group's other upkeep
    (``upkeep``: a timeout set on the group since, IPC waits released again)."""

    _PERIOD_S = 1.0

    def __init__(
        self, inflight: Callable[[], list[Collective]], upkeep: Callable[[], None]
    ) -> None:
        self._inflight = inflight
        self._upkeep = upkeep
        self.next_due = time.monotonic() + self._PERIOD_S

    def tick(self, now: float) -> None:
        self.next_due = now + self._PERIOD_S
        try:
            self._upkeep()
        except Exception:  # the engine thread serves every group: it must live on
            logger.exception("freescale: the group's upkeep raised")
        for op in self._inflight():
            if op.finished or op.needs_engine:
                continue
            try:
                op.poll_final(awaited_too=True)
                if not op.finished and now > op.deadline:
                    op.expire()
            except Exception:  # the engine thread serves every group: it must live on
                logger.exception("freescale: finishing or expiring %s raised", op.label)


class GroupContext:
    """One group's peers, endpoints, sequence numbers and health (see the module docstring).

    Args:
        store: the group's c10d store.
        keys: this incarnation of the group's keys (``directory.incarnation_keys`` of ``store``).
        rank: this rank in the group.
        size: ranks in the group.
        timeout: bound on every collective of the group.
        options: how data moves.
        invalid_options: why this rank's options were refused, if they were.
        world_ranks: the world rank of each of the group's ranks (c10d's
            ``global_ranks_in_group``; empty for the world group), which errors name (``who``).
    """

    def __init__(
        self,
        store: dist.Store,
        keys: dist.Store,
        rank: int,
        size: int,
        timeout: timedelta,
        options: FreescaleOptions,
        invalid_options: str | None = None,
        world_ranks: Sequence[int] = (),
    ) -> None:
        if size > MAX_GROUP_SIZE:
            raise FreescaleError(f"groups of more than {MAX_GROUP_SIZE} ranks are not supported")
        self.store = store
        self.rank = rank
        self.size = size
        # The group's world ranks in group-rank order (``2-3, 6``), or "" where they are its
        # own ranks: named by its errors (``who``, ``where``).
        ranks = tuple(world_ranks)
        self.world_rank_spans = "" if ranks in ((), tuple(range(size))) else rank_spans(ranks)
        self.timeout_s = timeout.total_seconds()
        self.options = options
        # Every header receive has this much room (see ``collective``): bounded per collective,
        # so that a group of hundreds of ranks does not allocate tens of MiB per call for it.
        self.eager_per_peer = min(options.eager_bytes, _EAGER_ROOM_BYTES // max(1, size - 1))
        # CPU data for a peer reached by outbox folds up to this (``fold_limit``).
        self.outbox_eager_per_peer = self.eager_per_peer
        self._broken: str | None = None
        self._seq = itertools.count(1)
        self._last_seq = 0  # of the last collective started here (``close``)
        # Collectives whose early messages the rings were told to discard or let through
        # (``discard_early``, ``unstall_early``), until their tags come round again.
        self._marked_seqs: set[int] = set()
        self._outbox_seq = itertools.count(1)
        self._graveyard: list[tuple[Plan, list[torch.Tensor]]] = []
        # Started and not finished, and failed ones until the next call; successful ones
        # leave at once (``retire``): they hold the caller's tensors.
        self._inflight: list[Collective] = []
        self._inflight_lock = threading.Lock()
        # Called once by an abort: the futures of Gloo's collectives not done yet
        # (``work.DelegatedWork``), by a key of their own.
        self._abort_hooks: dict[int, Callable[[], None]] = {}
        self._abort_hook_keys = itertools.count()
        # Called on a thread of their own each time a peer's departure is read: the breaking
        # of Gloo's connections where a collective in flight there can never complete
        # (``point_to_point.GlooBreaker``), and waits for a failed Gloo call's cause.
        self._departure_hooks: dict[int, Callable[[], None]] = {}
        # The collectives run on the group's Gloo backend (``gloo_call``), numbered as Gloo
        # pairs them: in the order they reach it, under the lock.
        self._gloo_calls = 0
        self._gloo_call_lock = threading.Lock()
        self._gloo_calls_ended = False  # the count is this rank's departure record (``close``)
        # The handles of collectives on Gloo that may still run (``gloo_call``): a destroy
        # lets them finish, as the group's own, before its departure record counts them.
        self._gloo_inflight: list[tuple[dist.Work, Any]] = []
        self._launch_lock = threading.Lock()  # ``launch``
        self._launches_waiting = 0  # threads in ``launch`` waiting for its lock
        self._cuda: dict[int, CudaSupport] = {}
        self._ipc: dict[int, IpcPath] = {}
        self._closed = False
        self.liveness: Liveness | None = None
        self.outboxes: Any = None  # ``outbox.Outboxes`` with the peers on this host
        self.express_runs = 0  # collectives run to their end in their call (``Collective``)
        # Where the group's timeout is read again (``follow_timeout``).
        self._timeout_source: Callable[[], timedelta] | None = None
        self._gloo_waits: dict[int, float] = {}  # when each wait on Gloo began
        self._gloo_polls: dict[int, tuple[float, dist.Work]] = {}  # ``gloo_polled``
        self._gloo_wait_keys = itertools.count()
        self._sealed = _SealedDeadlines(self.inflight, self._upkeep)
        self._links: list[Any] = [None] * size
        self._hub: Any = None
        try:
            self.transport = Transport.acquire()
        except ImportError as err:
            self._fail_set_up_without_ucx(store, keys, invalid_options, err)
        cuda_device = _cuda_device()
        self.engine = Engine.acquire(self.transport, cuda_device)
        self.callbacks = CallbackRunner(cuda_device)  # of the futures (``futures``)
        try:
            self._set_up(store, keys, invalid_options)
        except BaseException:
            # A peer that died or stalled during set-up (every store wait is bounded by the
            # group timeout), /dev/shm full, ...: what this rank acquired is given back.
            self.close()
            raise

    def _fail_set_up_without_ucx(
        self, store: dist.Store, keys: dist.Store, invalid_options: str | None, err: ImportError
    ) -> NoReturn:
        """Takes part in the set-up agreement (``_check_agreement``) as a rank that refused its
        options, so that every rank's set-up fails once every rank has joined instead of
        waiting for this one until the group timeout; then raises ``err`` (which names the
        package to install), also where the agreement itself fails (a peer that never joins).
        """
        logger.error("freescale: rank %d cannot create its group: %s", self.rank, err)
        refusal = invalid_options or f"rank {self.rank} cannot load UCX: {err}"
        with contextlib.suppress(Exception):  # this rank's own error is ``err``
            self._join(store, keys, refusal, b"")
        raise err

    def _join(
        self,
        store: dist.Store,
        keys: dist.Store,
        invalid_options: str | None,
        address: bytes,
        lookups: dist.Store | None = None,
    ) -> None:
        """The set-up exchange of every rank (``directory``), then the agreement check, which
        raises on every rank where some rank's options differ or were refused."""
        from freescale_comm import shm

        self._keys = keys
        agreement = directory.setup_agreement(self.options.shared(), invalid_options)
        directory.start(keys, root_store(store), self.rank, agreement)
        wait = timedelta(seconds=self.timeout_s)
        self.directory = directory.Directory(
            keys,
            self.rank,
            self.size,
            shm.host_identity(),
            address,
            wait,
            process_identity(),
            lookups,
        )
        self.group_id = self.directory.group_id
        self._check_agreement(agreement, invalid_options)

    def _set_up(self, store: dist.Store, keys: dist.Store, invalid_options: str | None) -> None:
        """Directory, liveness, the paths within the host (``__init__``)."""
        rank, size, options = self.rank, self.size, self.options
        # Set-up order: every rank beats once before its directory entry is published, and
        # rank 0 writes the keys a poll reads before any entry; once the directory has seen
        # every entry, every key a liveness poll reads exists (a ``multi_get`` of a missing
        # key would wait for it).
        own = own_connection(keys)  # for the liveness thread and lookups during collectives
        self.liveness = Liveness(
            own, rank, size, options.heartbeat_s, options.dead_after_s, self.abort
        )
        self._join(store, keys, invalid_options, self.transport.address, own)
        self.liveness.watch_processes(
            {p: who for p, who in self.directory.host_processes.items() if p != rank}
        )
        self.liveness.start()
        self.engine.watch(self._sealed)
        self._endpoints: list[Any] = [None] * size
        self._header_room = Signature.size(size) + self.eager_per_peer
        # Where the host's ranks outnumber its cores, a waiting rank hands its core to a peer.
        self._cores = usable_cores()
        self.idle_poll_s = idle_poll_s(
            options.idle_wait, len(self.directory.same_host), self._cores
        )
        self.alone_yields = alone_yields(len(self.directory.same_host), self._cores)
        self.local_copies = LocalCopies(
            helper_threads(options.host_copy_threads, len(self.directory.same_host), self._cores),
            self.transport.wake,
        )
        self._setup_host_paths()
        if self.outboxes is not None:  # the peers of this host mark their departure there
            self.liveness.local_departures = self.outboxes.departures
            self.liveness.local_aborts = self.outboxes.aborts
        self.liveness.on_departure = self._departure_read

    def _check_agreement(self, mine: str, invalid_options: str | None) -> None:
        """Fails set-up on every rank where some rank's options that every rank must share, or
        its wire version (``mine``: ``directory.setup_agreement``), differ from rank 0's, or
        where some rank's options were refused (``invalid_options``): its collectives would
        otherwise time out, fail obscurely or return wrong data."""
        first = self.directory.first_rank_agreement
        if self._agree("shared_options", mine == first and invalid_options is None):
            return
        differences = self._agreement_differences(mine)  # every rank takes part, this one too
        here = f"freescale group {self.group_id}, rank {self.rank}"
        if invalid_options is not None:
            raise FreescaleValidationError(
                f"{here}: invalid FreescaleOptions on this rank: {invalid_options} (its group "
                "fails on every rank)"
            )
        raise FreescaleValidationError(
            f"{here}: FreescaleOptions fields that must be the same on every rank, the "
            "freescale_comm wire versions, or whether a rank refused its options, differ "
            f"between ranks: {differences}" + ("" if mine == first else f" (this rank has {mine})")
        )

    def _agreement_differences(self, mine: str) -> str:
        """Which ranks differ from rank 0, and where (``directory.agreement_differences``):
        every rank publishes its agreement, rank 0 reads them all and publishes the summary
        (O(N) store reads, only when set-up fails). Rank 0's own agreement if that exchange
        does not finish within 10 s: a rank of an older version, or one that died since, never
        takes part, and the set-up must fail at once all the same."""
        keys, wait = self._keys, timedelta(seconds=min(self.timeout_s, 10.0))
        keys.set(f"shared_options/{self.rank}", mine)
        try:
            if self.rank == 0:
                every = [f"shared_options/{r}" for r in range(self.size)]
                keys.wait(every, wait)
                agreements = [bytes(v).decode() for v in keys.multi_get(every)]
                keys.set("shared_options/differences", directory.agreement_differences(agreements))
            keys.wait(["shared_options/differences"], wait)
            return keys.get("shared_options/differences").decode()
        except RuntimeError:  # torch's store errors (a peer gone since)
            return f"rank 0 has {self.directory.first_rank_agreement}"

    def _setup_host_paths(self) -> None:
        """Sets up the shared-memory rings with the peers on this host."""
        from freescale_comm import shm

        options, rank, size = self.options, self.rank, self.size
        local = [p for p in self.directory.same_host if p != rank]
        self._links: list[Any] = [None] * size
        self._hub: Any = None
        self._no_rings: dict[int, str] = {}
        self._ipc_peers: frozenset[int] = frozenset()
        self._all_on_staging_rings = False
        self.outboxes = None
        # Why a peer on this host is not reached by outbox (where ``shm_outbox_bytes`` > 0).
        self._no_outboxes = "not every pair on a host shares rings"
        unsupported = shm.rings_supported()
        # Every rank of the group takes part in the store exchange the same way: whether rings
        # are wanted depends only on the options, which are the same on every rank.
        if options.host_path == "ucx" or size == 1:
            self._no_rings = dict.fromkeys(local, f"host_path={options.host_path}")
            self.ring_max_bytes, self.ring_max_why = 0, "no rings"
            return
        if unsupported is not None:
            local_ok: list[int] = []
            self._no_rings = dict.fromkeys(local, unsupported)
        else:
            local_ok = local
        peers = max(1, len(local_ok))
        slots = max(2, min(64, options.shm_pool_bytes // (peers * options.shm_slot_bytes)))
        links, failures = shm.open_links(
            self._keys,
            rank,
            local_ok,
            slots,
            options.shm_slot_bytes,
            self.timeout_s,
            staging=_staging_rings(options, peers),
            reads=options.host_reads and options.host_path == "auto",
            read_threads=self.local_copies.threads,
        )
        self._no_rings.update(failures)
        if failures:
            logger.warning(
                "freescale: group %d, rank %d: no shared-memory rings with %s; their bytes "
                "take UCX, which is slower",
                self.group_id,
                rank,
                "; ".join(f"rank {p} ({why})" for p, why in sorted(failures.items())),
            )
        for peer, link in links.items():
            self._links[peer] = link
        self._ipc_peers = frozenset(links)
        if links:
            self._hub = shm.Hub.get()
            self.transport.attach_hub(self._hub)
        self.ring_max_bytes, self.ring_max_why = self._ring_limit(local_ok, slots)
        if self.one_host:
            self._all_on_staging_rings = self._agree(
                "staging_rings", all(self.stages_on_rings(p) for p in local)
            )
        if options.shm_outbox_bytes > 0:
            self._setup_outboxes(local if unsupported is None else [], links)

    def _ring_limit(self, local: list[int], slots: int) -> tuple[int, str]:
        """The largest message the rings carry, and why. ``shm_max_bytes=-1``: 512 KiB where
        torch's CPU tensors get huge pages on every rank (a read of a larger message pins them
        cheaply) or every rank splits its reads over helper threads; else as measured between
        this host's ranks (``host_probe``), the same on every rank of the host: a pair of ranks
        shares a host, so both of its sides choose alike. ``local``: the peers on this host
        with rings; ``slots``: of each ring."""
        from freescale_comm import host_probe
        from freescale_comm.info import tensors_get_huge_pages

        options = self.options
        if options.host_path == "shm":
            return EVERY_SIZE, "host_path=shm"
        if options.shm_max_bytes != -1:
            return options.shm_max_bytes, f"shm_max_bytes={options.shm_max_bytes}"
        # Every agreement on every rank, in this order (each is a store round of the group).
        huge = self._agree("huge_pages", tensors_get_huge_pages())
        # Without reads (host_reads=False) a lower limit would send the larger messages by UCX.
        spare = self._agree("spare_cores", options.host_reads and self.local_copies.threads > 1)
        if huge or spare:
            why = (
                "torch's CPU tensors get huge pages on every rank"
                if huge
                else "every rank splits its reads over helper threads (host_copy_threads)"
            )
            return READ_ABOVE_BYTES, why
        host_ranks = sorted([self.rank, *local])
        at = host_ranks.index(self.rank)
        after, before = host_ranks[(at + 1) % len(host_ranks)], host_ranks[at - 1]
        to_after, from_before = self._links[after], self._links[before]
        can_probe = options.host_reads and (
            not local
            or (
                to_after is not None
                and from_before is not None
                and to_after.host.reads_out
                and from_before.host.reads_in
            )
        )
        if not self._agree("host_probe", can_probe):
            return EVERY_SIZE, (
                "4 KiB pages for torch's CPU tensors on some rank, no read helpers on some, "
                "and no reads to measure on some"
            )
        processes = [self.directory.host_processes[r] for r in host_ranks]
        key = host_probe.verdict_key(processes, slots, options.shm_slot_bytes)
        cached = host_probe.cached_verdict(key) if local else None
        # Every rank of the group says whether it has the verdict (a rank alone on its host
        # needs none): either all of a host's ranks measure or none does.
        reuse = self._agree("host_probe_cached", cached is not None or not local)
        if not local:
            return EVERY_SIZE, "no peer on this host"
        if reuse and cached is not None:  # every rank of the host has it
            verdict = cached
        else:
            verdict = self._measure_host_paths(host_ranks, local)
            host_probe.keep_verdict(key, verdict)
        limit = READ_ABOVE_BYTES if verdict.reads else EVERY_SIZE
        return limit, f"4 KiB pages, no read helpers; {verdict.why()}"

    def _measure_host_paths(self, host_ranks: list[int], local: list[int]) -> ProbeVerdict:
        """``host_probe.measure_host`` with the ranks of this host (``local``: the others),
        stopped by one whose process exits, one that gives up its set-up (its side of the rings
        closed) or an abort."""
        from freescale_comm import host_probe
        from freescale_comm.liveness import gone_processes, watchable_processes

        watched = watchable_processes({r: self.directory.host_processes[r] for r in local})

        def stop() -> str | None:
            gone = gone_processes(watched)
            if gone:
                return f"the process of rank {gone[0]} on this host has exited"
            links = [(p, self._links[p]) for p in local]
            closed = [p for p, link in links if link is not None and link.host.peer_closed]
            if closed:
                return f"rank {closed[0]} gave up the set-up"
            return self.broken

        # Its messages take sequence number 0: they are all delivered before any rank of the
        # host leaves the probe (each waits for every rank's figures), so before any collective
        # of the group sends one.
        return host_probe.measure_host(
            self._hub,
            self._keys,
            self.rank,
            host_ranks,
            self._links,
            lambda src, sub: make_tag(self.group_id, 0, src, sub),
            self.timeout_s,
            stop,
        )

    def _setup_outboxes(self, local: list[int], links: dict[int, Any]) -> None:
        """The outboxes (``outbox``) between this rank and ``local``, the peers on its host
        it can share memory with. Every rank of the group calls it; the group uses outboxes
        only if every rank made and mapped its segments with all of its own (a rank alone on
        its host has none to make), so both sides of a pair on one host agree."""
        from freescale_comm import outbox, shm

        if not local:
            self._agree("outboxes", True)
            return
        # Room for any header a CUDA collective sends (its own limit), and for CPU data up to
        # the box's share per peer (alignment padding off each message).
        peers = len(local)
        box_bytes = max(self.options.shm_outbox_bytes, peers * (self._header_room + 64))
        boxes, why = outbox.open_outboxes(
            self._keys,
            self._hub or shm.Hub.get(),
            links,
            self.rank,
            self.size,
            [self.rank, *local],
            box_bytes,
            self.timeout_s,
        )
        try:
            agreed = self._agree("outboxes", boxes is not None and all(p in links for p in local))
        except BaseException:
            if boxes is not None:
                boxes.close()
            raise
        if agreed:
            self.outboxes = boxes
            self._hub.watch(boxes)
            if self.eager_per_peer > 0:
                share = self.options.shm_outbox_bytes // peers - Signature.size(self.size) - 64
                # Larger pieces move faster as reads (one copy) than in the outbox (two).
                share = min(share, self.ring_max_bytes)
                self.outbox_eager_per_peer = max(self.eager_per_peer, share)
        elif boxes is not None:
            boxes.close()
        if self.outboxes is None:
            self._no_outboxes = why or self._no_outboxes
            logger.warning(
                "freescale: group %d, rank %d: headers go as ring messages, not through "
                "outboxes, which is slower: %s",
                self.group_id,
                self.rank,
                self._no_outboxes,
            )

    def reaches_by_outbox(self, peer: int) -> bool:
        """Whether this rank's headers to ``peer`` (and the peer's to it) take the outboxes."""
        return self.outboxes is not None and self.outboxes.reaches(peer)

    def fold_limit(self, peer: int, on_cuda: bool) -> int:
        """The bytes for ``peer`` that travel inside a header: the outbox's share for CPU data
        to a peer reached by outbox, ``eager_per_peer`` otherwise (both sides of a pair agree:
        they share the host, or both use the option)."""
        if on_cuda or not self.reaches_by_outbox(peer):
            return self.eager_per_peer
        return self.outbox_eager_per_peer

    def _agree(self, name: str, mine: bool) -> bool:
        """Whether ``mine`` holds on every rank of the group (every rank must call it, in the
        same order): each reports to the store, the last to report publishes the verdict. A
        rank's links are its own view (a pair whose rings could not be made lacks them on its
        two ranks only), so a choice every rank must make alike cannot rest on them alone."""
        keys, prefix = self._keys, f"freescale/agree/{name}"
        keys.add(f"{prefix}/no", 0 if mine else 1)  # before reporting: the verdict counts it
        if keys.add(f"{prefix}/reported", 1) == self.size:
            keys.set(f"{prefix}/verdict", "1" if keys.add(f"{prefix}/no", 0) == 0 else "0")
        keys.wait([f"{prefix}/verdict"], timedelta(seconds=self.timeout_s))
        return keys.get(f"{prefix}/verdict") == b"1"

    def post(
        self, peer: int, buffer: Any, tag: int, send: bool, sub: int, ready: Any = None
    ) -> Any:
        """Posts one tagged send to / receive from ``peer`` on the path for its size: the
        shared-memory ring for host bytes between ranks of one host (``host_path``), the
        staging rings for staged CUDA bytes (given ``ready``, the CUDA event their copies
        wait for), UCX otherwise. A header (``sub`` 0) counts as its largest size, which both
        sides know."""
        link = self._links[peer]
        if link is not None:
            if ready is not None:
                self.cuda(buffer.device.index).attach(link.staging)
                return self._hub.post(link, buffer, tag, send, ready)
            if not isinstance(buffer, np.ndarray):
                return self.post_ucx(peer, buffer, tag, send)
            nbytes = self._header_room if sub == 0 else len(buffer)
            if nbytes <= self.ring_max_bytes:
                return self._hub.post(link, buffer, tag, send)
            if sub != 0 and self._read_by_receiver(link, nbytes, send):
                if send:
                    self.offer_to_readers([buffer], tag)
                return self._hub.post(link, buffer, tag, send, by_read=True)
        return self.post_ucx(peer, buffer, tag, send)

    def reads_named(self, peer: int, nbytes: int, send: bool) -> bool:
        """Whether a CPU data message of ``nbytes`` sent to (``send``) or received from
        ``peer`` is read by its receiver from the sender's memory at the address the sender's
        header names (``named_reads``): the headers are judged (``validate``) and go through
        the outboxes, and ``post`` would have the receiver read the message."""
        link = self._links[peer]
        return (
            link is not None
            and self.options.validate
            and self.reaches_by_outbox(peer)
            and self._read_by_receiver(link, nbytes, send)
        )

    def _read_by_receiver(self, link: Any, nbytes: int, send: bool) -> bool:
        """Whether a host message of ``nbytes`` on ``link`` is read by its receiver from the
        sender's memory: larger than the rings take, in a direction the kernel allows (both
        sides know: ``shm.open_links``); else (above the rings' limit) it takes UCX."""
        return nbytes > self.ring_max_bytes and (
            link.host.reads_out if send else link.host.reads_in
        )

    def offer_to_readers(self, buffers: Iterable[np.ndarray], tag: int) -> None:
        """Notes sends of the collective of ``tag`` that peers read from this process's memory
        (``host_huge_pages``): the whole tensor each is a piece of (a plan's byte views are
        slices of one flat view per tensor) goes onto 2 MiB pages once it recurs."""
        if not self.options.host_huge_pages:
            return
        wholes = {}
        for buffer in buffers:
            whole = buffer.base if isinstance(buffer.base, np.ndarray) else buffer
            wholes[id(whole)] = whole
        for whole in wholes.values():
            huge_pages.sending(whole.ctypes.data, whole.nbytes, tag >> SUB_BITS)

    def reader_of(self, peer: int) -> Any:
        """The host channel to ``peer`` (``reads_named``): its process id, the reads counted."""
        return self._links[peer].host

    def post_ucx(self, peer: int, buffer: Any, tag: int, send: bool) -> Any:
        """Posts one tagged send to / receive from ``peer`` on UCX, whatever its host: UCX
        matches messages to receives by tag, where a ring delivers them in the order sent."""
        endpoint = self.endpoint(peer)
        transport = self.transport
        return (
            transport.send(endpoint, buffer, tag) if send else transport.recv(endpoint, buffer, tag)
        )

    def stages_on_rings(self, peer: int) -> bool:
        """Whether staged CUDA bytes to and from ``peer`` take the staging rings."""
        link = self._links[peer]
        return link is not None and link.staging is not None

    @property
    def one_host(self) -> bool:
        """Whether every rank of the group is on this host (the same answer on every rank)."""
        return len(self.directory.same_host) == self.size

    @property
    def all_on_staging_rings(self) -> bool:
        """Whether every rank reaches every peer through the staging rings (the group on one
        host, every pair's rings made): agreed at set-up, the same answer on every rank, which
        a collective's choices that both sides of a pair must make alike (folding, algorithm)
        may depend on."""
        return self._all_on_staging_rings

    def sends_early(self, peer: int, nbytes: int) -> bool:
        """Whether a data message of ``nbytes`` to ``peer`` leaves with the headers: it takes a
        ring, where it waits for the receiver's verdict and is then copied once into the output,
        as a message sent after the verdict would be."""
        if self._links[peer] is None or nbytes > _EARLY_BYTES:
            return False
        return nbytes <= self.ring_max_bytes

    def holds_back_early_sends(self, seq: int) -> bool:
        """Whether an earlier collective than ``seq`` may still post data to the host rings.
        A ring delivers in order and holds data that arrives before its receive is posted, so
        ``seq``'s data sent early would sit ahead of that earlier data: a peer that waits for
        the earlier collective before it calls ``seq`` would wait for ever."""
        return any(op.seq < seq and op.may_post_host_data for op in self.inflight())

    def discard_early(self, seq: int) -> None:
        """Drops what peers sent or will send to the rings for collective ``seq``, and its
        receives posted there (its verdict was bad, or it failed later)."""
        self._marked_seqs.add(seq)
        for link, prefix in self._ring_prefixes(seq):
            self._hub.discard(link, prefix)

    def unstall_early(self, seq: int) -> None:
        """Lets what peers sent early for collective ``seq`` leave the rings before its receive
        is posted (a second header round follows it)."""
        self._marked_seqs.add(seq)
        for link, prefix in self._ring_prefixes(seq):
            self._hub.unstall(link, prefix)

    def paths(self) -> list[dict[str, Any]]:
        """Per peer: the path host bytes take to it, and why (``freescale comm info``)."""
        rows = []
        options = self.options
        threads = self.local_copies.threads
        waits = (
            (
                f"polls for {self.idle_poll_s * 1e6:.0f} us, yielding its core, then sleeps "
                if self.idle_poll_s
                else "sleeps "
            )
            + f"(idle_wait={options.idle_wait}; {len(self.directory.same_host)} ranks on this "
            f"host, {self._cores} cores); copies its own pieces and reads peers' memory "
            + (
                f"on {threads} helper and {threads} reader threads (a call alone in flight that "
                f"reads at most {INLINE_READ_BYTES >> 20} MiB in all: in its call)"
                if threads > 1
                else "itself"
            )
            + f" (host_copy_threads={options.host_copy_threads})"
        )
        for peer in range(self.size):
            if peer == self.rank:
                continue
            same = peer in self.directory.same_host
            if self._links[peer] is not None:
                if options.host_path == "shm":
                    path, why = "shm", "same host; host_path=shm"
                elif self.ring_max_bytes >= EVERY_SIZE:
                    path, why = "shm", f"same host; rings at every size: {self.ring_max_why}"
                else:
                    host = self._links[peer].host
                    above = {
                        (True, True): "read from the sender's memory",
                        (False, False): "ucx",
                    }.get((host.reads_out, host.reads_in), "read one way, ucx the other")
                    path = f"shm <= {self.ring_max_bytes} B, {above} above"
                    why = f"same host; host_path=auto, by size: {self.ring_max_why}"
                    if not options.host_reads:
                        why += "; host_reads=False"
                    elif above != "read from the sender's memory":
                        why += "; the kernel refused a read of a peer's memory (ptrace)"
            elif same:
                path, why = "ucx", f"same host, no rings: {self._no_rings.get(peer, '?')}"
            else:
                path, why = "ucx", f"other host ({self.directory.host_of(peer)})"
            link = self._links[peer]
            rows.append(
                {
                    "rank": self.rank,
                    "peer": peer,
                    "path": path,
                    "why": why,
                    "host": self.directory.host,
                    "peer_host": self.directory.host_of(peer),
                    "ring_messages": (link.sent, link.received) if link else (0, 0),
                    "ring_slots": link.inc.slots if link else 0,
                    "ring_reads": link.host.reads if link else 0,  # of the peer's memory
                    "ring_split_reads": link.host.split_reads if link else 0,
                    "helper_copy_jobs": self.local_copies.jobs,
                    "headers": self._headers_path(peer),
                    "waits": waits,
                    "outbox_posts": self.outboxes.posted if self.outboxes is not None else 0,
                    "cuda": self._cuda_path_of(peer),
                    "ipc_pushes": sum(path.pushes_to(peer) for path in self._ipc.values()),
                }
            )
        return rows

    def _headers_path(self, peer: int) -> str:
        """How each collective's header messages to ``peer`` travel, and why (``freescale comm
        info``)."""
        if self.reaches_by_outbox(peer):
            return f"outboxes (CPU data up to {self.outbox_eager_per_peer} B per peer inside)"
        if peer not in self.directory.same_host:
            return "messages (other host)"
        if self.options.shm_outbox_bytes == 0:
            return "messages (shm_outbox_bytes=0)"
        return f"messages (no outboxes: {self._no_outboxes})"

    def cuda_path(self) -> str:
        """How CUDA tensors move: ``ipc`` (with the peers this rank shares rings with; the
        others through ``remote_cuda_path``), ``direct`` or ``staged`` (``cuda_path``, what UCX
        can do); the same answer on every rank, and each pair takes the same path on both
        sides: IPC within a pair that shares rings (links are made in pairs), the remote path
        between the others."""
        if self.options.cuda_path in ("ipc", "auto") and self.size > 1:
            return "ipc"  # also where no peer shares this host: the plans say so alike
        return self.remote_cuda_path()

    def remote_cuda_path(self) -> str:
        """How CUDA bytes move to the peers this rank shares no rings with, and with every
        peer for a plan IPC cannot carry: ``staged`` under ``cuda_path="ipc"``, else the
        configured path, ``auto`` meaning ``direct`` where UCX has CUDA (cuda_copy / cuda_ipc)
        and ``staged`` otherwise; the same answer on every rank whose UCX agrees (a plan's
        signature carries it)."""
        path = self.options.cuda_path
        if path == "ipc":
            return "staged"
        if path == "auto":
            return "direct" if self.transport.cuda_support else "staged"
        return path

    @property
    def ipc_peers(self) -> frozenset[int]:
        """The peers that CUDA IPC reaches: those of this host this rank shares rings with
        (their first page holds the pair's flags)."""
        return self._ipc_peers

    def _cuda_path_of(self, peer: int) -> str:
        """How CUDA bytes travel to ``peer``, and why (``freescale comm info``)."""
        if _cuda_device() is None:
            return "none: this process sees no CUDA device"
        path = self.cuda_path()
        if path == "ipc" and peer in self.ipc_peers:
            from freescale_comm.ipc import MAILBOX_SLOT_BYTES

            return (
                "ipc: copy-engine copies through CUDA IPC (sends that fit a mailbox slot "
                f"of {MAILBOX_SLOT_BYTES >> 10} KiB pushed into the peer's mailbox at the "
                "call, larger ones pulled from the sender's memory), flags in shared page-locked "
                "memory; same host (a ring, or a call whose descriptors do not fit in "
                "eager_bytes, takes the remote path with every peer)"
            )
        no_ipc = ""
        if path == "ipc":
            path = self.remote_cuda_path()
            if peer in self.directory.same_host:  # CUDA IPC needs the pair's rings (flags)
                no_ipc = f"; no CUDA IPC: {self._no_rings.get(peer, 'no rings')}"
        if path == "direct":
            return (
                "direct: UCX device buffers (cuda_ipc / GPUDirect RDMA); cuda_path="
                f"{self.options.cuda_path}{no_ipc}"
            )
        if self.stages_on_rings(peer):
            return "staged: staging rings (page-locked shared memory, D2H in, H2D out); same host"
        why = "other host" if peer not in self.directory.same_host else "no staging rings"
        return f"staged: pinned pool + UCX host messages; {why}{no_ipc}"

    @property
    def ipc_max_pieces(self) -> int:
        """How many pieces for one peer an IPC descriptor in a header's room can name."""
        from freescale_comm.ipc import pieces_in

        return pieces_in(self.eager_per_peer)

    def ipc_fits(self, plan: Plan) -> bool:
        """Whether every peer's IPC descriptor of ``plan`` fits in a header's room: the same
        answer on ranks whose calls agree, from the signature's tensor count (at least the
        pieces for any peer), not from the pieces this rank sends (empty ones send none)."""
        return max(plan.signature.count, plan.most_sends_to_one_peer) <= self.ipc_max_pieces

    def ipc(self, device: int) -> IpcPath:
        """The IPC path's stream, flags and mappings for ``device``, made on first use."""
        path = self._ipc.get(device)
        if path is None:
            from freescale_comm.ipc import IpcPath

            links = {p: link for p, link in enumerate(self._links) if link is not None}
            host_ranks = self.directory.same_host
            watch = self.cuda(device).h2d_watch.watch
            path = self._ipc[device] = IpcPath(
                device, links, self.rank, host_ranks, watch, self.transport.wake
            )
        return path

    def follow_timeout(self, source: Callable[[], timedelta]) -> None:
        """Reads the group's timeout from ``source`` from now on, at each collective's start and
        each second: torch's ``_set_pg_timeout`` (torchtitan shortens the timeout after the
        first step) sets it on the group's Gloo / NCCL backends only. Collectives started after
        a change get it."""
        self._timeout_source = source

    def current_timeout_s(self) -> float:
        """The group's timeout, with one set since on its backends (``follow_timeout``)."""
        source = self._timeout_source
        if source is not None:
            seconds = source().total_seconds()
            if seconds > 0:
                self.timeout_s = seconds
        return self.timeout_s

    def _upkeep(self) -> None:
        """Each second on the engine thread: takes up a timeout set on the group since
        (``follow_timeout``: the group's own waits outside collectives use it too); aborts the
        group where a wait on its Gloo backend, or a poll of one, cannot end
        (``gloo_wait_began``, ``gloo_polled``); once the group is aborted, releases the IPC
        waits again until the streams drain (``IpcPath.keep_released``)."""
        self.current_timeout_s()
        started = list(self._gloo_waits.values())
        for key, (since, work) in list(self._gloo_polls.items()):  # (a caller may add one)
            if work.is_completed():
                self._gloo_polls.pop(key, None)
            else:
                started.append(since)
        if started and self._broken is None:
            # As for the group's own collectives (``health_error``): the liveness thread,
            # blocked in a store request that is never answered, cannot abort it then.
            waited = time.monotonic() - min(started)
            error = self.health_error(waited)
            if error is not None:
                # On a thread of its own: the abort waits for the liveness thread, blocked in
                # the store request, and the engine thread serves every group.
                reason = f"rank {self.rank}: a wait on the Gloo backend: {error}"
                threading.Thread(
                    target=self.abort, args=(reason,), name="freescale-comm-abort", daemon=True
                ).start()
        if self._broken is not None:
            for path in list(self._ipc.values()):
                path.keep_released()

    def gloo_wait_began(self, since: float) -> int:
        """Marks a wait on the group's Gloo backend begun (a collective or a send / recv it
        runs there), which the abort ends (``work.DelegatedWork``, ``point_to_point``), waiting
        since ``since`` (``time.monotonic()`` of the first wait on its handle: a caller may
        wait in slices); returns what ``gloo_wait_ended`` takes. Where it lasts past
        ``dead_after_s`` while the store has not answered that long, the group is aborted
        (``_upkeep``)."""
        key = next(self._gloo_wait_keys)
        self._gloo_waits[key] = since
        return key

    def gloo_wait_ended(self, key: int) -> None:
        self._gloo_waits.pop(key, None)

    def gloo_polled(self, work: dist.Work, since: float) -> None:
        """Marks Gloo's collective ``work`` polled by a caller that has not seen it completed
        since ``since`` (``DelegatedWork.is_completed``): it counts as a wait on Gloo
        (``gloo_wait_began``) until it completes (not Gloo's send / recv, which are completed
        only once waited for)."""
        self._gloo_polls[next(self._gloo_wait_keys)] = (since, work)

    def mailbox_path(self) -> IpcPath | None:
        """The IPC path whose mailbox the peers of this host push into: the first one made
        (a peer maps the first mailbox a descriptor names), or None before any."""
        return next(iter(self._ipc.values()), None)

    def next_seq(self) -> int:
        seq = next(self._seq)
        if self._marked_seqs:
            # Tags repeat every 2^SEQ_BITS collectives: what the rings were told about a
            # collective (discard, unstall) ends half a round later, long after its last
            # message and before a peer ahead of this rank sends one that repeats its tags.
            earlier = seq - (1 << (SEQ_BITS - 1))
            if earlier in self._marked_seqs:
                self._marked_seqs.discard(earlier)
                for link, prefix in self._ring_prefixes(earlier):
                    self._hub.forget(link, prefix)
        return seq

    def _ring_prefixes(self, seq: int) -> list[tuple[Any, int]]:
        """(link, tag prefix of collective ``seq``'s messages from that peer) per ring link."""
        return [
            (link, make_tag(self.group_id, seq, peer, 0) >> SUB_BITS)
            for peer, link in enumerate(self._links)
            if link is not None
        ]

    def next_outbox_seq(self) -> int:
        """The outbox number of the next collective that sends headers (``outbox``)."""
        return next(self._outbox_seq)

    def endpoint(self, peer: int) -> Any:
        """The UCX endpoint to group rank ``peer`` (created on first use)."""
        endpoint = self._endpoints[peer]
        if endpoint is None:
            address = self.directory.address(peer)  # read from the store on first use
            endpoint = self._endpoints[peer] = self.transport.endpoint(address)
        return endpoint

    def cuda(self, device: int) -> CudaSupport:
        """Streams, watchers and staging pool for ``device``, made on first use."""
        support = self._cuda.get(device)
        if support is None:
            from freescale_comm.cuda import CudaSupport

            support = self._cuda[device] = CudaSupport(
                device,
                self.transport.wake,
                self.options.staging_pool_bytes,
                self.options.chunk_bytes,
            )
        return support

    def launch(self, op: Collective, caller_waits: bool) -> None:
        """Starts ``op`` and hands it to the engine thread, or to its caller to drive.

        Args:
            op: the collective.
            caller_waits: the caller calls ``wait`` at once (``async_op=False``), so it may
                progress the collective itself (``Engine.claim``): a CPU one to its end, a CUDA
                one until its last copies are queued (its ``wait`` blocks until then anyway),
                which saves the hand-offs between threads that dominate a small collective.
                A CUDA caller must have the collective's device current (UCX's CUDA
                transports use the progressing thread's context). Otherwise only a small CPU
                one may run to its end here (``Collective.start``), and its ``wait`` may take
                it back from the engine thread (``Engine.take_back``).
        """
        # Numbered, started and listed in flight as one step: a thread that took the number
        # before another and started after it would send behind that later collective's early
        # data, which a peer calling in number order never receives (the rings deliver in
        # order), and would take the outbox and IPC numbers out of order.
        self._refuse_if_closed(op)
        if caller_waits:  # before the number is taken
            self.refuse_wait_on_engine_thread(
                lambda: f"freescale {op.name} (group {self.group_id})"
            )
        # Counted only where the lock is taken now (an uncontended launch pays nothing; one that
        # loses a race for a free lock waits uncounted, as before the count).
        counted = self._launch_lock.locked()
        if counted:
            self._count_launch_waiting(1)
        try:
            with self._launch_lock:  # a ``with``: no interrupt can leave it taken
                if counted:
                    self._count_launch_waiting(-1)
                    counted = False
                self._refuse_if_closed(op)  # ``close`` sets it under this lock
                departed = self.departure_error(self._last_seq + 1)
                if departed is not None:  # no number taken, no abort: every peer knows as well
                    raise FreescalePeerError(f"freescale {op.name} ({self.where}): {departed}")
                alone = True
                for earlier in self.inflight():
                    earlier.poll_final()  # the CUDA ones whose end event completed since
                    alone = alone and earlier.finished
                op.seq = self._last_seq = self.next_seq()
                try:
                    # Alone in flight, a collective may run to its end here
                    # (``Collective.start``): no earlier one can still need its place in the
                    # outboxes or rings, and none can start meanwhile (this lock).
                    # Not an asynchronous one on the engine thread (a callback chained there),
                    # which would hold up every group's progress while it polls and reads.
                    express = alone and (caller_waits or not self.engine.is_engine_thread())
                    op.start(express=express, caller_waits=caller_waits)
                except BaseException as err:  # an interrupt too: the number is taken all the same
                    failure: BaseException | None = err
                else:
                    failure = None
                    with self._inflight_lock:
                        self._inflight = [c for c in self._inflight if not c.finished]
                        if not op.finished:
                            self._inflight.append(op)
        finally:
            if counted:  # the wait for the lock was interrupted
                self._count_launch_waiting(-1)
        if failure is not None:
            # This rank took the collective's sequence number, its peers never see its
            # messages: they would wait out the group timeout, and every later collective
            # would pair the wrong calls. The group is told now (an error of the caller's own
            # arguments under validate=False, a CUDA driver call that failed, a full /dev/shm,
            # a KeyboardInterrupt).
            # Outside the lock: the abort fails the collectives in flight under their locks,
            # and a thread finishing one of them may run callbacks (chained in C++) that start
            # a collective of this group.
            if self.broken is None:
                why = str(failure) or type(failure).__name__  # an interrupt has no text
                self.abort(f"rank {self.rank}: {op.label} could not start: {why}")
            raise failure
        if op.finished:
            return
        if not (caller_waits and self.drivable_here(op) and self.engine.claim(op)):
            self.engine.submit(op)

    @staticmethod
    def drivable_here(op: Collective) -> bool:
        """Whether the calling thread may progress ``op``: a CUDA one only with its device
        current (UCX's CUDA transports and the IPC path's driver calls use the progressing
        thread's context)."""
        return not op.on_cuda or _current_device() == op.plan.cuda_index

    def _count_launch_waiting(self, change: int) -> None:
        """Counts a thread in ``launch`` that waits for its lock (``launch_waiting``)."""
        with self._inflight_lock:
            self._launches_waiting += change

    @property
    def launch_waiting(self) -> bool:
        """Whether another thread waits to start a collective of this group (an express
        collective, which holds the lock while it polls, then leaves its polls to the engine)."""
        return self._launches_waiting > 0

    def _refuse_if_closed(self, op: Collective) -> None:
        """Raises if the group is shut down: a collective started then (a callback the
        shut-down runs as it fails the one it is chained to, a call after it) would never be
        progressed, and the shut-down would wait for it until the group timeout."""
        if self._closed:
            raise FreescaleError(
                f"freescale {op.name} ({self.where}): the process group was shut down"
            )

    def refuse_wait_on_engine_thread(self, what: Callable[[], str]) -> None:
        """Raises, and aborts the group, if the calling thread is the engine thread.

        C++ runs the callbacks that ``torch.futures.collect_all`` chains where the last future
        completes: on the engine thread, where a wait would hang until the group timeout, or
        on the thread that attached the callback once every future is done, where the same
        callback's collective runs. Which one is timing, so ranks can disagree: the group is
        aborted, so that the peers raise as well instead of waiting for (or pairing with the
        next call) a collective this rank never starts. ``what`` names the call; made only
        then (every wait asks).
        """
        if not self.engine.is_engine_thread():
            return
        error = (
            f"{what()}: a collective cannot be waited for in a callback chained with "
            "torch.futures.collect_all, which runs on freescale's engine thread (nothing else "
            "would progress the collective); attach it to each collective's future instead "
            "(then / add_done_callback run on the group's callback thread)"
        )
        if self.broken is None:
            # The peers read the abort key within one poll; here the liveness thread, once it
            # has written it, aborts the group (``on_failure``), outside the lock of the
            # collective this thread may be completing.
            self.liveness.request_abort(f"rank {self.rank}: {error}", _ABORT_WRITE_WAIT_S)
        raise FreescaleError(f"{error}; the group is aborted on every rank")

    def on_abort(self, hook: Callable[[], None]) -> Callable[[], None]:
        """Calls ``hook`` once the group is aborted (at once where it is already); returns
        what forgets it, for a hook whose cause ended first."""
        with self._inflight_lock:
            if self._broken is None:
                key = next(self._abort_hook_keys)
                self._abort_hooks[key] = hook
                return lambda: self._abort_hooks.pop(key, None)
        hook()
        return lambda: None

    def inflight(self) -> list[Collective]:
        """The collectives started and not finished (and failed ones until the next call)."""
        with self._inflight_lock:
            return list(self._inflight)

    def await_inflight(self) -> None:
        """Blocks until the collectives in flight now have finished, each within its bound
        (``Collective.await_finish``)."""
        for op in self.inflight():
            op.await_finish()

    def retire(self, op: Collective) -> None:
        """Forgets a collective that succeeded, from any thread."""
        with self._inflight_lock:
            if op in self._inflight:
                self._inflight.remove(op)

    def keep_alive(self, plan: Plan, pinned: list[torch.Tensor]) -> None:
        """Keeps a failed collective's buffers alive: a cancelled UCX request may still read."""
        self._graveyard.append((plan, pinned))

    # ----------------------------------------------------------------- health
    def health_error(self, waited_s: float) -> str | None:
        """Why a collective of this group that has waited ``waited_s`` cannot finish
        (abort, a silent peer; or, once it has waited ``dead_after_s``, a store unreachable that
        long: this rank cannot see its peers' deaths then), or None.

        What the liveness thread's last poll found: no store request here."""
        error = self.liveness.error()
        if error is None and waited_s > self.liveness.dead_after_s:
            silence = self.liveness.store_silence()
            if silence is not None:
                error = f"{silence}, and this collective has waited {waited_s:.0f} s"
        return error

    def departure_error(self, seq: int) -> str | None:
        """Why collective ``seq`` cannot finish because a peer destroyed the group before
        finishing it (``Liveness.departed``, as of the last poll), or None."""
        left = self._left_before(seq, lambda record: record.finished)
        if not left:
            return None
        who = ", ".join(f"rank {peer} after collective #{done}" for peer, done in left)
        return f"a peer destroyed the process group ({who}), so collective #{seq} cannot complete"

    def _left_before(self, number: int, count: Callable[[Departure], int]) -> list[tuple[int, int]]:
        """(rank, its ``count``) of each peer that destroyed the group with ``count`` below
        ``number`` (``Liveness.departed``, as of the last poll), in rank order."""
        departed = self.liveness.departed
        return [
            (peer, count(record))
            for peer, record in sorted(departed.items())
            if count(record) < number
        ]

    def gloo_call(
        self, call: Callable[[], dist.Work], what: str, wrap: Callable[[dist.Work, int], Any]
    ) -> Any:
        """Runs ``call`` (``what``, a collective on the group's Gloo backend) and returns
        ``wrap(Gloo's handle, its number among them on this rank from 1)``
        (``work.DelegatedWork``), kept for ``close`` to wait for until Gloo's is completed
        (each call drops those completed: they hold their tensors); raises
        ``FreescalePeerError`` instead where a peer is known to have destroyed the group
        without running it (Gloo would wait for it until its timeout, and so would the
        group's destroy). Where two threads call at once, the numbers follow the order in
        which Gloo took their calls, which is how it pairs them across ranks."""
        with self._gloo_call_lock:
            if self._gloo_calls_ended:
                raise FreescaleError(f"{self.who}: {what}: the process group was shut down")
            number = self._gloo_calls + 1
            departed = self.gloo_departure_error(number)
            if departed is not None:
                raise FreescalePeerError(f"{self.who}: {what} on Gloo: {departed}")
            work = call()  # a call Gloo refuses (its own argument checks) takes no number
            self._gloo_calls = number
            handle = wrap(work, number)
            self._gloo_inflight = [
                (inner, kept) for inner, kept in self._gloo_inflight if not inner.is_completed()
            ]
            self._gloo_inflight.append((work, handle))
            return handle

    def _await_gloo_inflight(self) -> None:
        """Lets the collectives on Gloo that this rank started and nobody waited for finish
        (each ends at the latest once the group is aborted or a peer left without running
        it), within the group timeout in all: a peer that calls one after this rank's
        destroy began still gets its data, and the departure record counts only what ran."""
        with self._gloo_call_lock:
            pending, self._gloo_inflight = self._gloo_inflight, []
        until = time.monotonic() + self.timeout_s
        for _, handle in pending:
            left = until - time.monotonic()
            if left <= 0:
                return
            with contextlib.suppress(Exception):  # its error is its waiter's, if any
                handle.wait(timedelta(seconds=left))

    def gloo_departure_error(self, call: int) -> str | None:
        """Why the ``call``-th collective on the group's Gloo backend cannot finish because a
        peer destroyed the group without running it (``Liveness.departed``, as of the last
        poll), or None."""
        left = self._left_before(call, lambda record: record.gloo_calls)
        if not left:
            return None
        who = ", ".join(f"rank {peer} after {count} on Gloo" for peer, count in left)
        return (
            f"a peer destroyed the process group ({who}), so its collective #{call} on Gloo "
            "cannot complete"
        )

    def gloo_doomed(self) -> str | None:
        """Why a collective on Gloo that this rank started and Gloo has not completed never
        will (a peer destroyed the group without running it: ``gloo_departure_error``), or
        None."""
        with self._gloo_call_lock:
            pending = [handle for inner, handle in self._gloo_inflight if not inner.is_completed()]
        for handle in pending:
            departed = self.gloo_departure_error(handle.number)
            if departed is not None:
                return departed
        return None

    def on_departure(self, hook: Callable[[], None]) -> Callable[[], None]:
        """Calls ``hook`` (on a thread of its own) each time a peer's departure is read from
        now on; returns what forgets it."""
        with self._inflight_lock:
            key = next(self._abort_hook_keys)
            self._departure_hooks[key] = hook
        return lambda: self._departure_hooks.pop(key, None)

    def _departure_read(self) -> None:
        """``Liveness.on_departure``: runs the departure hooks off the liveness thread (a
        breaking of Gloo's connections waits for it, up to half a second: ``GlooBreaker``)."""
        with self._inflight_lock:
            hooks = list(self._departure_hooks.values())
        if not hooks:
            return

        def run() -> None:
            for hook in hooks:
                hook()

        threading.Thread(target=run, name="freescale-comm-departure", daemon=True).start()

    @property
    def who(self) -> str:
        """This rank as the errors raised to the caller name it: ``rank R``, and in a group
        whose ranks are not the world's, ``rank R of group G (world ranks ...)``, which also
        tells which processes the group ranks in the rest of the message are."""
        spans = self.world_rank_spans
        if not spans:
            return f"rank {self.rank}"
        return f"rank {self.rank} of group {getattr(self, 'group_id', '?')} (world ranks {spans})"

    @property
    def where(self) -> str:
        """The group and this rank, as the labels of its collectives name them."""
        spans = self.world_rank_spans
        world = f", world ranks {spans}" if spans else ""
        return f"group {self.group_id}, rank {self.rank} of {self.size}{world}"

    @property
    def broken(self) -> str | None:
        """Why the group is unusable (its first abort), or None: later collectives raise."""
        if self._broken is not None or self.liveness is None:  # (a set-up that failed early)
            return self._broken
        return self.liveness.abort_reason

    def broken_after_gloo_failed(self) -> str | None:
        """``broken``, once Gloo failed a call of this group: waiting up to two liveness polls
        for an abort on its way, or until a peer's departure is read, since where a peer
        aborted the group (``point_to_point``) or left it and exited, Gloo's connections to it
        close before this rank's next poll reads why."""
        if self.broken is None and self.liveness is not None:
            arrived = threading.Event()
            forget_abort = self.on_abort(arrived.set)
            forget_departure = self.on_departure(arrived.set)
            arrived.wait(2 * self.liveness.poll_s)
            forget_abort()
            forget_departure()
        return self.broken

    def describe_peers(self, peers: list[int]) -> str:
        """ "ranks [a, b]" plus how long each watched one has been silent, where that is notable."""
        return self.liveness.describe(peers)

    def abort(self, reason: str) -> None:
        """Marks the group broken, tells every rank through the store (first reason wins) and
        fails what is in flight; also when liveness found the failure first (``on_failure``),
        which no collective may be polling (a sealed IPC collective waits on the GPU only)."""
        hooks: list[Callable[[], None]] = []
        if self._broken is None:
            self._broken = reason
            # Also where no call of the group names it: Gloo's futures (DDP's) fail with
            # Gloo's error once the abort fails its connections.
            logger.error("freescale: %s: the group is aborted by %s", self.who, reason)
            if self.outboxes is not None:  # for the peers of this host, without the store
                self.outboxes.mark_aborted(reason)
            # Written by the liveness thread, waited for a moment (a process that exits
            # right after the error must still tell its peers); its host may be stopped.
            self.liveness.request_abort(reason, _ABORT_WRITE_WAIT_S)
            for op in self.inflight():
                op.poll_final(awaited_too=True)  # done on the GPU, not yet polled: a success
                op.fail(f"the group was aborted by {reason}", "peer")
            with self._inflight_lock:
                hooks, self._abort_hooks = list(self._abort_hooks.values()), {}
        # After the failures (a collective whose GPU waits pass must not finish as a success):
        # the GPU must not wait forever for a dead peer's flags.
        for path in list(self._ipc.values()):
            path.release()
        # Last: they run the callbacks chained to Gloo's futures, which may wait for anything.
        for hook in hooks:
            hook()

    def close(self, wait_for_callbacks: bool = True) -> None:
        """Ends what is still in flight, frees the CUDA side, gives back engine and transport.

        Args:
            wait_for_callbacks: let the collectives in flight finish (each within its
                timeout; those on Gloo nobody waited for, within the group timeout in all)
                and wait up to the group timeout for the callbacks still running; else (an
                abort, which must return promptly) fail them at once and give the callbacks
                1 s. The engine thread, which serves every group, never waits longer than
                that.
        """
        with self._launch_lock:  # no collective starts after this (``launch``)
            if self._closed:
                return
            self._closed = True
        if wait_for_callbacks and self.broken is None and not self.engine.is_engine_thread():
            self.await_inflight()
            self._await_gloo_inflight()
        # The peers of a group that lives on learn that this rank left, how many of its
        # collectives it finished first (``departure_error``: those it fails now not among
        # them) and how many it ran on Gloo (``gloo_departure_error``). An aborted group's
        # peers know enough.
        left_after = self._last_seq
        for op in self.inflight():
            op.poll_final(awaited_too=True)  # done on the GPU, not yet polled: a success
            if not op.finished:
                left_after = min(left_after, op.seq - 1)
            op.fail("the process group was shut down", "internal")
        with self._inflight_lock:
            self._inflight = []
        # The callbacks still to run, as Gloo's destroy waits for them; a collective of the
        # group's own they start raises now (``launch``), one on Gloo runs (and is counted in
        # the departure record), so only the user's own code can outlast the timeout.
        patient = wait_for_callbacks and not self.engine.is_engine_thread()
        if not self.callbacks.close(timeout_s=self.timeout_s if patient else 1.0):
            logger.warning(
                "freescale: a callback of group %s still runs; its thread is left", self.group_id
            )
        with self._gloo_call_lock:  # no collective on Gloo after the record's count
            self._gloo_calls_ended = True
            gloo_calls = self._gloo_calls
        leaving = None if self.broken is not None else Departure(left_after, gloo_calls)
        if leaving is not None and self.outboxes is not None:
            self.outboxes.mark_left(leaving)
        self._departure_hooks.clear()
        self.engine.unwatch(self._sealed)
        # Both refer back to this context: without them it is freed with its last reference,
        # not at the next garbage collection. The timeout's source holds the group's Gloo,
        # whose threads end when it is freed.
        self._sealed = None
        self._timeout_source = None
        self._gloo_polls.clear()  # Gloo's works (and their tensors), some never to complete
        if self.liveness is not None:
            self.liveness.stop(leaving)
        self.engine.release()
        for link in self._links:
            if link is not None:
                self._hub.detach(link)  # other groups' threads progress the hub meanwhile
        paths, self._ipc = list(self._ipc.values()), {}  # the upkeep sees none from now on
        for path in paths:
            path.close()
        for support in self._cuda.values():
            support.close()
        self._cuda = {}
        if self.outboxes is not None:
            self._hub.unwatch(self.outboxes)
            self.outboxes.close()
            self.outboxes = None
        for peer, link in enumerate(self._links):
            if link is not None:
                self._hub.remove(link)
                self._links[peer] = None
        self.transport.release()
        self._endpoints = [None] * self.size


def _staging_rings(options: FreescaleOptions, peers: int) -> tuple[int, int] | None:
    """(slots, slot bytes) of the CUDA staging rings per peer on this host: a process that can
    use CUDA makes them (sparse until first used); half the staging pool receives."""
    import torch

    if not torch.cuda.is_available():
        return None
    chunk = options.chunk_bytes
    return max(2, min(64, options.staging_pool_bytes // 2 // (peers * chunk))), chunk


def _current_device() -> int:
    """The calling thread's current CUDA device (CUDA is initialised: a CUDA collective runs);
    without ``torch.cuda.is_available``, which costs microseconds per call."""
    import torch

    return torch._C._cuda_getDevice()


def _cuda_device() -> int | None:
    """The CUDA device UCX's progress thread must use, if this process uses CUDA at all."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.current_device()


def rank_spans(ranks: Sequence[int], most: int = 8) -> str:
    """``ranks`` in order, runs of consecutive ranks as ``first-last`` (``[2, 3, 4, 9]``:
    ``2-4, 9``), the first ``most`` runs and an ellipsis where there are more."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    shown = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:most]]
    return ", ".join(shown + ["..."] * (len(runs) > most))
