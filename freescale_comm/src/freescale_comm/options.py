"""Backend options: one typed dataclass, filled from ``FREESCALE_*`` environment variables.

Pass an instance as ``pg_options`` to ``init_process_group`` / ``new_group``; fields left at their
defaults there fall back to the environment, so a launcher can tune a job without code changes.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import numbers
import os
from dataclasses import dataclass
from typing import Literal

AllGatherAlgorithm = Literal["auto", "direct", "ring"]
CudaPath = Literal["auto", "direct", "staged", "ipc"]
HostPath = Literal["auto", "ucx", "shm"]
IdleWait = Literal["auto", "sleep", "yield"]

logger = logging.getLogger(__name__)

_ENV_PREFIX = "FREESCALE_"
# The rings' largest message under ``shm_max_bytes=-1``: where reads win (reads above it), and
# where they do not (no host message is that large).
READ_ABOVE_BYTES = 512 << 10
EVERY_SIZE = 1 << 40

HOST_ENV = "FREESCALE_HOST_ID"  # the host identity (``shm.host_identity``), not a field
# What both sides of a message must agree on: whether headers are exchanged, what travels
# inside them, the algorithm and its chunks, and the path each kind of bytes takes; and what
# liveness watchers judge their neighbours by.
SHARED_FIELDS = (
    "validate",
    "eager_bytes",
    "allgather",
    "ring_threshold_bytes",
    "chunk_bytes",
    "cuda_path",
    "host_path",
    "shm_max_bytes",
    "shm_slot_bytes",
    "shm_outbox_bytes",
    "heartbeat_s",
    "dead_after_s",
)


@dataclass(frozen=True)
class FreescaleOptions:
    """How a ``freescale`` process group moves data.

    Attributes:
        validate: exchange a small signature (op, dtype, per-peer byte counts) with every peer
            before any data moves, so mismatched inputs fail on every rank with a clear error.
            Costs one round of tiny messages, which carries the data itself where it is small
            (``eager_bytes``). Must be the same on every rank. ``FREESCALE_VALIDATE``.
        eager_bytes: data (CPU, or CUDA staged through page-locked memory) of at most this many
            bytes per peer travels inside the validation header (one message and one round trip
            per peer instead of two); every header receive buffer has this much room. Must be
            the same on every rank. CPU data in a group with outboxes folds up to their share
            instead (``shm_outbox_bytes``). ``FREESCALE_EAGER_BYTES``.
        allgather: ``direct`` (every rank sends its piece to every peer at once), ``ring``
            (chunk-pipelined ring) or ``auto`` (ring for pieces of at least
            ``ring_threshold_bytes`` when there are more than two ranks; direct in a group on
            one host, and for CUDA tensors under ``cuda_path`` ``ipc`` / ``auto``).
            ``FREESCALE_ALLGATHER``.
        ring_threshold_bytes: ``auto`` switches to the ring from this piece size on.
            ``FREESCALE_RING_THRESHOLD_BYTES``.
        chunk_bytes: pipelining unit of the ring AllGather and of the staged CUDA path (its
            staging slot size). ``FREESCALE_CHUNK_BYTES``.
        cuda_path: for CUDA tensors, ``ipc`` (with the peers on this host it shares rings
            with: copy-engine copies through memory mapped by CUDA IPC, ordered on the GPU by
            flags; ``staged`` with the others), ``direct`` (device buffers handed to UCX:
            cuda_ipc / RDMA), ``staged`` (copy-engine D2H into pinned host memory, host
            transfer, H2D; chunks pipelined) or ``auto`` (``ipc`` as above, and with the others
            ``direct`` if UCX has CUDA, else ``staged``). A call IPC cannot carry (a ring, or
            descriptors past a header's room) takes that other path with every peer. Under
            ``ipc`` and ``auto`` CUDA AllGathers take the direct algorithm, in a group spanning
            hosts unless ``allgather="ring"``. The same on every rank (validation checks it).
            ``FREESCALE_CUDA_PATH``.
        staging_pool_bytes: page-locked host memory of a group's staged path (half for send
            chunks, half for receive chunks, at least four chunks; allocated on the first staged
            collective, freed when the group is destroyed). ``FREESCALE_STAGING_POOL_BYTES``.
        host_path: how CPU bytes move between ranks of one host: ``shm`` (the group's
            shared-memory rings), ``ucx`` (UCX: shared memory for small messages, cross-memory
            attach for large ones) or ``auto`` (rings for messages of up to ``shm_max_bytes``,
            above that read from the sender's memory, ``host_reads``). ``ucx`` also leaves
            staged CUDA bytes without the staging rings; the staged pipeline's chunks always
            take UCX. Ranks on other hosts always use UCX. Same on every rank.
            ``FREESCALE_HOST_PATH``; the host identity is ``FREESCALE_HOST_ID`` (default:
            hostname and boot id).
        shm_max_bytes: ``auto`` sends messages up to this size through the rings (and folds
            CPU pieces up to it into the headers, ``shm_outbox_bytes``). -1 (the default): 512
            KiB (``READ_ABOVE_BYTES``) where every rank's torch CPU tensors get huge pages
            (``info.tensors_get_huge_pages``: a read of a larger message pins the sender's pages
            cheaply and beats the rings' two copies from a few MiB) or, with ``host_reads``,
            every rank has helper threads (``host_copy_threads``: on a 16-vCPU host reads beat
            the rings from 4 MiB, split over threads from 64 MiB by 3x); else 512 KiB or every
            size, whichever the host's ranks measure faster at set-up (``host_probe``: with
            4 KiB pages the rings won on one 2-core machine, the reads on another). The same on
            every rank. ``FREESCALE_SHM_MAX_BYTES``.
        host_reads: under ``auto``, a larger message is read by its receiver straight from
            the sender's memory (``process_vm_readv``: one copy, as UCX's cross-memory attach,
            but a sender that died fails the collective instead of aborting the reader), where
            the kernel allows it (probed per direction at set-up); else, or with False, UCX.
            ``FREESCALE_HOST_READS``.
        host_huge_pages: a CPU send buffer that a peer reads from this process's memory
            (``host_reads``) and that a second collective sends again is moved onto 2 MiB
            pages once (``huge_pages``: ``madvise(MADV_COLLAPSE)``, Linux 6.1+; about one
            copy of it), so that the peers' reads look up one page per 2 MiB instead of 512. A
            rank's own choice. ``FREESCALE_HOST_HUGE_PAGES``.
        shm_slot_bytes: size of one ring slot (the pipelining unit). Same on every rank.
            ``FREESCALE_SHM_SLOT_BYTES``.
        shm_pool_bytes: the rings a process receives into, per group: split over its peers on
            the host, 2 to 64 slots each. ``FREESCALE_SHM_POOL_BYTES``.
        shm_outbox_bytes: between the ranks of a group that share a host (where every pair of
            a host has rings), each rank writes every collective's header messages for them
            into an outbox of its own, which they read in place (``outbox``: two boxes of this
            many bytes per rank and group, or room for each such peer's ``eager_bytes`` if
            more), and a CPU piece for such a peer travels inside its header up to
            ``shm_outbox_bytes / (peers on the host)`` less the header (and at most
            ``shm_max_bytes`` under ``host_path="auto"``), in place of ``eager_bytes`` (0 there
            still turns folding off). Peers on other hosts: messages.
            Same on every rank; 0: no outboxes, headers take the rings.
            ``FREESCALE_SHM_OUTBOX_BYTES``.
        idle_wait: how a thread that progresses collectives waits when nothing moved: ``sleep``
            in an epoll at once, until a peer's wake-up (a system call on each side and a
            scheduler wake-up per wait; no core spent polling), or ``yield`` its core between
            polls (``sched_yield``: a message is seen without a wake-up, and a peer that needs
            the core gets it) for up to ``engine.YIELD_S`` without progress, then sleep.
            ``auto``: ``yield`` where the group's ranks on this host outnumber the cores this
            process may use (``cpu.usable_cores``: its affinity mask, capped by its cgroup's CPU
            quota; a waiting rank then hands its core to a peer with work, as
            Open MPI's ``mpi_yield_when_idle`` does when oversubscribed), else the same for up
            to ``engine.POLL_S`` (100 µs, about a wake-up's cost) only: where every rank has a
            core, polling for longer takes cores and the GIL from the work a process does
            beside its collectives, such as a training step's background threads. Where ranks
            outnumber cores, a thread also sleeps once 16 yields in a row found no other
            thread ready on its core (``engine.yield_core``).
            ``FREESCALE_IDLE_WAIT``.
        host_copy_threads: helper threads that copy a CPU collective's own pieces (its local
            copies) of 2 MiB and more in all, split between them, while the thread that
            progresses it moves its messages (``local_copies``), and as many reader threads,
            which read the messages of several peers from their memory at once (``shm``). 1:
            that thread copies them itself once the messages are posted, and reads one message
            after another (as a collective alone in flight that reads at most
            ``local_copies.INLINE_READ_BYTES`` in all does either way). 0 (``auto``): the cores
            this process may use per rank of the group on this host, at most 8, and 1 where
            that is below 2 (a host with a core or less per rank copies fastest on one thread).
            At most 64; a rank's own choice. ``FREESCALE_HOST_COPY_THREADS``.
        heartbeat_s: interval of the liveness heartbeat each process writes to the store.
            ``FREESCALE_HEARTBEAT_S``.
        dead_after_s: a peer whose heartbeat is older than this is reported dead and fails the
            collectives waiting on it. A peer on this host is not while its process runs; on
            other hosts this must outlast any one call that holds Python's GIL (``liveness``).
            ``FREESCALE_DEAD_AFTER_S``.
    """

    validate: bool = True
    eager_bytes: int = 64 << 10
    allgather: AllGatherAlgorithm = "auto"
    ring_threshold_bytes: int = 1 << 20
    chunk_bytes: int = 4 << 20
    cuda_path: CudaPath = "auto"
    staging_pool_bytes: int = 64 << 20
    host_path: HostPath = "auto"
    shm_max_bytes: int = -1
    host_reads: bool = True
    host_huge_pages: bool = True
    shm_slot_bytes: int = 256 << 10
    shm_pool_bytes: int = 4 << 20
    shm_outbox_bytes: int = 2 << 20
    idle_wait: IdleWait = "auto"
    host_copy_threads: int = 0
    heartbeat_s: float = 1.0
    dead_after_s: float = 10.0

    def __post_init__(self) -> None:
        choices = {
            "allgather": ("auto", "direct", "ring"),
            "cuda_path": ("auto", "direct", "staged", "ipc"),
            "host_path": ("auto", "ucx", "shm"),
            "idle_wait": ("auto", "sleep", "yield"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"FreescaleOptions.{name} must be one of {allowed}")
        for item in dataclasses.fields(self):
            value, kind = getattr(self, item.name), type(item.default)
            # bool is an int: a flag must be a bool, a count an integer and not a bool.
            if kind is bool and not isinstance(value, bool):
                raise ValueError(f"FreescaleOptions.{item.name} must be a bool")
            if kind is int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                raise ValueError(f"FreescaleOptions.{item.name} must be an integer")
            if kind is float and (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or not math.isfinite(value)
            ):
                raise ValueError(f"FreescaleOptions.{item.name} must be a finite number")
            if kind is float:  # 30 and 30.0 are one setting: ranks compare them as text
                object.__setattr__(self, item.name, float(value))
        if self.ring_threshold_bytes < 0:
            raise ValueError("ring_threshold_bytes must be >= 0")
        if self.shm_max_bytes < -1:
            raise ValueError("shm_max_bytes must be >= 0, or -1 (by the pages of the tensors)")
        if self.chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be > 0")
        if self.eager_bytes < 0:
            raise ValueError("eager_bytes must be >= 0")
        if self.staging_pool_bytes < 4 * self.chunk_bytes:
            raise ValueError("staging_pool_bytes must hold at least four chunks (4 * chunk_bytes)")
        if self.shm_slot_bytes < 4096 or self.shm_pool_bytes < 2 * self.shm_slot_bytes:
            raise ValueError("shm_slot_bytes must be >= 4096 and shm_pool_bytes >= 2 slots")
        if self.shm_outbox_bytes < 0:
            raise ValueError("shm_outbox_bytes must be >= 0")
        if not 0 <= self.host_copy_threads <= 64:
            raise ValueError("host_copy_threads must be 0 (auto) to 64")
        if not (self.heartbeat_s > 0 and self.dead_after_s > 2 * self.heartbeat_s):
            raise ValueError("heartbeat_s must be > 0 and dead_after_s > 2 * heartbeat_s")

    def shared(self) -> str:
        """The fields every rank of a group must set alike (``SHARED_FIELDS``), as text: a group
        whose ranks differ there fails its set-up on every rank, naming them."""
        return ", ".join(f"{name}={_plain(getattr(self, name))!r}" for name in SHARED_FIELDS)

    @classmethod
    def from_env(cls, base: FreescaleOptions | None = None) -> FreescaleOptions:
        """Returns ``base`` (or the defaults) with every field set in the environment replaced.

        An explicitly passed ``pg_options`` wins over the environment only for the fields it
        changed from the defaults, so ``FREESCALE_*`` still tunes everything else.
        """
        defaults = cls()
        values = {}
        _warn_of_misspelt_variables(
            [HOST_ENV] + [_ENV_PREFIX + f.name.upper() for f in dataclasses.fields(cls)]
        )
        for item in dataclasses.fields(cls):
            explicit = getattr(base, item.name) if base is not None else None
            if explicit is not None and explicit != getattr(defaults, item.name):
                values[item.name] = explicit
                continue
            raw = os.environ.get(_ENV_PREFIX + item.name.upper())
            if raw is None:
                continue
            values[item.name] = _parse(raw, type(getattr(defaults, item.name)), item.name)
        try:
            return cls(**values)
        except ValueError as err:
            given = ", ".join(f"{name}={value!r}" for name, value in values.items())
            raise ValueError(f"{err} (given: {given})") from None


_warned: set[str] = set()


def _warn_of_misspelt_variables(known: list[str]) -> None:
    """Warns once of a ``FREESCALE_*`` variable that is no option but nearly names one (other
    packages of the project have variables of their own under the prefix)."""
    for name in os.environ:
        if not name.startswith(_ENV_PREFIX) or name in known or name in _warned:
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
        if close:
            _warned.add(name)
            logger.warning("%s is not an option of the freescale backend (%s?)", name, close[0])


def _plain(value: object) -> object:
    """``value`` as the built-in type it stands for (a numpy integer is an int)."""
    if isinstance(value, bool | str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def _parse(raw: str, kind: type, name: str) -> object:
    try:
        if kind is bool:
            lowered = raw.strip().lower()
            if lowered not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(raw)
            return lowered in ("1", "true", "yes", "on")
        if kind is int:
            return int(raw, 0)
        if kind is float:
            return float(raw)
        return raw.strip().lower()
    except ValueError:
        variable = f"{_ENV_PREFIX}{name.upper()}"
        raise ValueError(f"{variable}={raw!r} is not a valid {kind.__name__}") from None
