"""The state of one freescale group: peers, tags, liveness and abort, shared by its collectives.

Created with the process group. Everything is agreed through the group's c10d store, which every
rank reaches: a group id for the tags (a counter in the root store, so overlapping groups never
share one), each rank's UCX worker address, and each process's heartbeat key.

Liveness is the backend's own job: UCX's peer-failure handling would force TCP (3-5x slower),
and without it a dead peer makes receives wait forever. So every process bumps a heartbeat
counter in the store; while a collective is in flight the engine checks, a few times a second,
the group's abort key and the peers' counters. A peer whose counter stops moving for
``dead_after_s`` is reported dead; the first rank that fails a collective for a peer-side reason
writes the abort key, so the other ranks fail fast with the same story instead of each waiting
for its own timeout.
"""

from __future__ import annotations

import itertools
import time
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import torch.distributed as dist

from freescale_comm.engine import Engine
from freescale_comm.errors import FreescaleError
from freescale_comm.options import FreescaleOptions
from freescale_comm.transport import MAX_GROUP_SIZE, SUB_BITS, Transport, make_tag
from freescale_comm.validation import Signature

if TYPE_CHECKING:
    import torch

    from freescale_comm.algorithms import Plan
    from freescale_comm.collective import Collective
    from freescale_comm.cuda import CudaSupport

# Identifies this process's heartbeat; the worker address would do too, but is 200+ bytes.
_PROCESS_ID = uuid.uuid4().hex[:16]
_ABORT_KEY = "freescale/abort"
_EAGER_ROOM_BYTES = 4 << 20
# Data messages up to this size leave with the headers over the rings (``sends_early``).
_EARLY_BYTES = 1 << 20


def root_store(store: dist.Store) -> dist.Store:
    """The store under every ``PrefixStore`` layer: the one all groups of the job share."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


class _Heartbeat:
    """Bumps this process's counter in the root store (called by the engine thread)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.key = f"freescale/hb/{_PROCESS_ID}"

    def beat(self) -> None:
        self.store.add(self.key, 1)


class GroupContext:
    """One group's peers, endpoints, sequence numbers and health (see the module docstring)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: timedelta,
        options: FreescaleOptions,
    ) -> None:
        if size > MAX_GROUP_SIZE:
            raise FreescaleError(f"groups of more than {MAX_GROUP_SIZE} ranks are not supported")
        self.store = store
        self.rank = rank
        self.size = size
        self.timeout_s = timeout.total_seconds()
        self.options = options
        # Every header receive has this much room (see ``collective``): bounded per collective,
        # so that a group of hundreds of ranks does not allocate tens of MiB per call for it.
        self.eager_per_peer = min(options.eager_bytes, _EAGER_ROOM_BYTES // max(1, size - 1))
        self.broken: str | None = None
        self._seq = itertools.count(1)
        self._graveyard: list[tuple[Plan, list[torch.Tensor]]] = []
        self._inflight: list[Collective] = []
        self._cuda: dict[int, CudaSupport] = {}
        self._closed = False
        self.transport = Transport.acquire()
        self.engine = Engine.acquire(options.heartbeat_s, self.transport, _cuda_device())
        root = root_store(store)
        self._root = root
        self._heartbeat = _Heartbeat(root)
        self.engine.add_heartbeat(self._heartbeat)
        if rank == 0:
            store.set("freescale/group_id", str(root.add("freescale/next_group_id", 1)))
        self.group_id = int(store.get("freescale/group_id"))
        store.set(f"freescale/peer/{rank}", _PROCESS_ID.encode() + self.transport.address)
        entries = store.multi_get([f"freescale/peer/{p}" for p in range(size)])
        self._addresses = [bytes(e[16:]) for e in entries]
        self._beat_keys = [f"freescale/hb/{bytes(e[:16]).decode()}" for e in entries]
        self._endpoints: list[Any] = [None] * size
        self._header_room = Signature.size(size) + self.eager_per_peer
        self._setup_host_paths()
        now = time.monotonic()
        self._beats: list[tuple[int, float]] = [(-1, now)] * size

    def _setup_host_paths(self) -> None:
        """Finds the peers on this host and sets up the shared-memory rings with them."""
        from freescale_comm import shm

        options, rank, size = self.options, self.rank, self.size
        host = shm.host_identity()
        self.store.set(f"freescale/host/{rank}", host)
        self.hosts = [
            v.decode() for v in self.store.multi_get([f"freescale/host/{p}" for p in range(size)])
        ]
        local = [p for p in range(size) if p != rank and self.hosts[p] == host]
        self._links: list[Any] = [None] * size
        self._hub: Any = None
        self._no_rings: dict[int, str] = {}
        unsupported = shm.rings_supported()
        # Every rank of the group takes part in the store exchange the same way: whether rings
        # are wanted depends only on the options, which are the same on every rank.
        if options.host_path == "ucx" or size == 1:
            self._no_rings = dict.fromkeys(local, f"host_path={options.host_path}")
            return
        if unsupported is not None:
            local_ok: list[int] = []
            self._no_rings = dict.fromkeys(local, unsupported)
        else:
            local_ok = local
        peers = max(1, len(local_ok))
        slots = max(2, min(64, options.shm_pool_bytes // (peers * options.shm_slot_bytes)))
        links, failures = shm.open_links(
            self.store,
            rank,
            local_ok,
            slots,
            options.shm_slot_bytes,
            self.timeout_s,
            staging=_staging_rings(options, peers),
        )
        self._no_rings.update(failures)
        for peer, link in links.items():
            self._links[peer] = link
        if links:
            self._hub = shm.Hub.get()
            self.transport.attach_hub(self._hub)

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
                return self._ucx_post(peer, buffer, tag, send)
            nbytes = self._header_room if sub == 0 else len(buffer)
            if self.options.host_path == "shm" or nbytes <= self.options.shm_max_bytes:
                return self._hub.post(link, buffer, tag, send)
        return self._ucx_post(peer, buffer, tag, send)

    def _ucx_post(self, peer: int, buffer: Any, tag: int, send: bool) -> Any:
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
    def all_on_staging_rings(self) -> bool:
        """Whether every peer is reached through the staging rings (every rank of the group on
        this host): the same answer on every rank, which a collective's choices that both sides
        of a pair must make alike (folding, algorithm) may depend on."""
        return self.size > 1 and all(
            self.stages_on_rings(p) for p in range(self.size) if p != self.rank
        )

    def sends_early(self, peer: int, nbytes: int) -> bool:
        """Whether a data message of ``nbytes`` to ``peer`` leaves with the headers: it takes a
        ring, and it is small enough that the receiver's extra copy out of the ring costs less
        than the round trip it saves."""
        if self._links[peer] is None or nbytes > _EARLY_BYTES:
            return False
        return self.options.host_path == "shm" or nbytes <= self.options.shm_max_bytes

    def discard_early(self, seq: int) -> None:
        """Drops what peers sent early for collective ``seq`` (its verdict was bad)."""
        for peer, link in enumerate(self._links):
            if link is not None:
                self._hub.discard(link, make_tag(self.group_id, seq, peer, 0) >> SUB_BITS)

    def paths(self) -> list[dict[str, Any]]:
        """Per peer: the path host bytes take to it, and why (``freescale comm info``)."""
        rows = []
        options = self.options
        for peer in range(self.size):
            if peer == self.rank:
                continue
            same = self.hosts[peer] == self.hosts[self.rank]
            if self._links[peer] is not None:
                if options.host_path == "shm":
                    path, why = "shm", "same host; host_path=shm"
                elif options.shm_max_bytes >= 1 << 40:
                    path, why = "shm", "same host; host_path=auto: rings at every size"
                else:
                    path = f"shm <= {options.shm_max_bytes} B, ucx above"
                    why = "same host; host_path=auto (the faster path per size)"
            elif same:
                path, why = "ucx", f"same host, no rings: {self._no_rings.get(peer, '?')}"
            else:
                path, why = "ucx", f"other host ({self.hosts[peer]})"
            link = self._links[peer]
            rows.append(
                {
                    "rank": self.rank,
                    "peer": peer,
                    "path": path,
                    "why": why,
                    "host": self.hosts[self.rank],
                    "peer_host": self.hosts[peer],
                    "ring_messages": (link.sent, link.received) if link else (0, 0),
                    "ring_slots": link.inc.slots if link else 0,
                    "cuda": self._cuda_path_of(peer),
                }
            )
        return rows

    def _cuda_path_of(self, peer: int) -> str:
        """How CUDA bytes travel to ``peer``, and why (``freescale comm info``)."""
        path = self.options.cuda_path
        if path == "auto":
            path = "direct" if self.transport.cuda_support else "staged"
        if path == "direct":
            return "direct: UCX device buffers (cuda_ipc / GPUDirect RDMA); cuda_path=" + (
                self.options.cuda_path
            )
        if self.stages_on_rings(peer):
            return "staged: staging rings (page-locked shared memory, D2H in, H2D out); same host"
        why = "other host" if self.hosts[peer] != self.hosts[self.rank] else "no staging rings"
        return f"staged: pinned pool + UCX host messages; {why}"

    def next_seq(self) -> int:
        return next(self._seq)

    def endpoint(self, peer: int) -> Any:
        """The UCX endpoint to group rank ``peer`` (created on first use)."""
        endpoint = self._endpoints[peer]
        if endpoint is None:
            endpoint = self._endpoints[peer] = self.transport.endpoint(self._addresses[peer])
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
                transports use the progressing thread's context).
        """
        op.start()
        self._inflight = [c for c in self._inflight if not c.finished]
        self._inflight.append(op)
        may_drive = caller_waits and (not op.plan.on_cuda or _cuda_device() == op.plan.cuda_index)
        if not (may_drive and self.engine.claim(op)):
            self.engine.submit(op)

    def keep_alive(self, plan: Plan, pinned: list[torch.Tensor]) -> None:
        """Keeps a failed collective's buffers alive: a cancelled UCX request may still read."""
        self._graveyard.append((plan, pinned))

    # ----------------------------------------------------------------- health
    def health_error(self) -> str | None:
        """Why this group's collectives cannot finish (abort or a silent peer), or None."""
        if self.store.check([_ABORT_KEY]):
            reason = self.store.get(_ABORT_KEY).decode(errors="replace")
            self.broken = self.broken or reason
            return f"the group was aborted by {reason}"
        now = time.monotonic()
        values = self._root.multi_get(self._beat_keys)
        dead = []
        for peer, raw in enumerate(values):
            value = int(raw)
            seen, since = self._beats[peer]
            if value != seen:
                self._beats[peer] = (value, now)
            elif peer != self.rank and now - since > self.options.dead_after_s:
                dead.append(peer)
        if dead:
            return f"{self.describe_peers(dead)}: its process died or is stopped"
        return None

    def describe_peers(self, peers: list[int]) -> str:
        """ "ranks [a, b]" plus how long each has been silent, where that is notable."""
        now = time.monotonic()
        notes = []
        for peer in peers:
            silent = now - self._beats[peer][1]
            if silent > 2 * self.options.heartbeat_s:
                notes.append(f"rank {peer} sent no heartbeat for {silent:.1f} s")
        listed = f"rank {peers[0]}" if len(peers) == 1 else f"ranks {peers}"
        return listed + (f" ({'; '.join(notes)})" if notes else "")

    def abort(self, reason: str) -> None:
        """Marks the group broken and tells every rank through the store (first reason wins)."""
        if self.broken:
            return
        self.broken = reason
        try:
            if not self.store.check([_ABORT_KEY]):
                self.store.set(_ABORT_KEY, reason)
        except Exception:  # the store's host may be the process that died
            pass
        for op in list(self._inflight):
            op.fail(f"the group was aborted by {reason}", "peer")

    def close(self) -> None:
        """Fails what is still in flight, frees the CUDA side, gives back engine and transport."""
        if self._closed:
            return
        self._closed = True
        for op in list(self._inflight):
            op.fail("the process group was shut down", "internal")
        self._inflight = []
        self.engine.remove_heartbeat(self._heartbeat)
        self.engine.release()
        for support in self._cuda.values():
            support.close()
        self._cuda = {}
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


def _cuda_device() -> int | None:
    """The CUDA device UCX's progress thread must use, if this process uses CUDA at all."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.current_device()
