"""The process's UCX side: one context, one worker, the endpoints to peer workers.

Every freescale group of the process shares this worker (UCX tag matching is worker-wide, so
tags carry group, sequence number, source rank and chunk; see ``make_tag``). The worker is in
blocking progress mode and is progressed by the engine thread (``engine``), which sleeps in the
worker's epoll while nothing moves: no idle CPU, and transfers advance while the training thread
computes.

ucxx is imported here and only here, lazily, so that importing ``freescale_comm`` (which torch
does at its own import through the ``torch.backends`` entry point) stays cheap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from typing import Any

from freescale_comm.errors import FreescaleError
from freescale_comm.options import HOST_ENV

logger = logging.getLogger(__name__)

# Tag layout (64 bits): group id | sequence number | source group rank | chunk.
GROUP_BITS, SEQ_BITS, SRC_BITS, SUB_BITS = 16, 20, 12, 16
MAX_GROUP_SIZE = 1 << SRC_BITS
MAX_SUB = (1 << SUB_BITS) - 1
_FULL_MASK = (1 << 64) - 1
# How long a release waits for its endpoints to close. A close flushes what the endpoint still
# sends, which may need the peer's acknowledgement; a live peer's engine progresses UCX every
# quarter of a second even while idle (``engine``), a dead or stopped one never does.
CLOSE_S = 3.0

_UCXX_MISSING = (
    "the freescale backend needs ucxx (UCX for Python), which is not installed. Install it with "
    "the extra that matches your CUDA: pip install 'freescale-comm[cu12]' (CUDA 12 or CPU only) "
    "or pip install 'freescale-comm[cu13]' (CUDA 13)"
)


def make_tag(group_id: int, seq: int, src: int, sub: int) -> int:
    """Packs one message's identity into a UCX tag.

    Args:
        group_id: process-group id, agreed through the store when the group was created.
        seq: the group's collective sequence number (wraps; only in-flight ones must differ).
        src: group rank of the sender.
        sub: message index inside the collective (0 is the validation header).
    """
    if not 0 <= sub <= MAX_SUB:
        raise FreescaleError(f"message index {sub} does not fit the tag ({MAX_SUB} at most)")
    seq &= (1 << SEQ_BITS) - 1
    group_id &= (1 << GROUP_BITS) - 1
    return (((group_id << SEQ_BITS | seq) << SRC_BITS | src) << SUB_BITS) | sub


def import_ucxx() -> Any:
    """Returns ``ucxx._lib.libucxx``, or raises an ImportError naming the extra to install."""
    # UCX 1.21 warns about UCX_MEMTYPE_CACHE, which ucxx sets on import; the warning is noise.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        import ucxx._lib.libucxx as libucxx
    except ImportError as err:
        raise ImportError(_UCXX_MISSING) from err
    return libucxx


def ucx_version() -> str | None:
    """UCX version as "major.minor.release", or None when ucxx is not installed."""
    try:
        libucxx = import_ucxx()
    except ImportError:
        return None
    return ".".join(str(part) for part in libucxx.get_ucx_version())


def context_config() -> dict[str, str]:
    """UCX options of the process's context (``UCX_*`` variables still apply).

    Where this process's host identity is overridden (``FREESCALE_HOST_ID``: a test, or nodes
    emulated on one machine), the "other hosts" it reaches by UCX may be this machine, where
    UCX's cross-memory attach aborts the reading process when its peer dies mid-read (4 ranks,
    64 MiB AllToAll, one killed: every survivor died of SIGABRT). A real other host never takes
    that transport, so it is left out here too (for this host's UCX pairs as well: the context is
    the process's), unless ``UCX_TLS`` says otherwise.
    """
    if os.environ.get(HOST_ENV) and "UCX_TLS" not in os.environ:
        return {"TLS": "^cma"}
    return {}


class Transport:
    """The process-wide UCX worker, its progress thread and the endpoints to peer workers.

    Obtained through ``Transport.acquire`` and given back with ``release``: the last release
    stops the progress thread and destroys the worker, so a destroyed process group leaves no
    thread behind.
    """

    _instance: Transport | None = None
    _users = 0
    _lock = threading.Lock()

    def __init__(self) -> None:
        self._ucx = import_ucxx()
        from ucxx._lib.arr import Array

        self._array = Array
        ucx = self._ucx
        self.context = ucx.UCXContext(
            context_config(), feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP)
        )
        # No ucxx progress thread: the engine thread progresses the worker and sleeps in its
        # epoll (GIL released) while requests are in flight, so a message that arrives wakes the
        # very thread that completes the collective. That is what keeps small collectives close
        # to the caller-driven latency (a C++ progress thread plus a polling Python thread cost
        # a thread hand-off and a poll interval per message), and it avoids ucxx issue #15 (a
        # blocking progress thread that never progresses a receive matched to an early
        # rendezvous message), since every wait is bounded and followed by a progress call.
        self.worker = ucx.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        # The thread that waits sleeps on an epoll of its own, over the worker's epoll fd and an
        # eventfd: ``wake`` (a submitted collective, a finished CUDA copy) interrupts the sleep,
        # which UCX's own ``progress_worker_event`` offers no way to do from Python.
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake_lock = threading.Lock()
        self._epoll = select.epoll()
        self._epoll.register(self.worker.epoll_file_descriptor, select.EPOLLIN)
        self._epoll.register(self._wake_fd, select.EPOLLIN)
        self.address: bytes = bytes(self.worker.address)
        self.cuda_support = bool(self.context.cuda_support)
        self._endpoints: dict[bytes, Any] = {}
        self._ep_lock = threading.Lock()
        # ucxx cancels a request under the request's mutex, then takes the worker's lock; a
        # progress call holds the worker's lock while a completing request's callback takes
        # that request's mutex. Cancelling while another thread progresses can deadlock both,
        # so the two are serialised here (``cancel``).
        self._progress_lock = threading.Lock()
        self._hub: Any = None  # the process's shared-memory rings (``shm.Hub``), once used

    def attach_hub(self, hub: Any) -> None:
        """Progresses ``hub``'s rings with the worker and sleeps on its wake-up socket too."""
        with self._ep_lock:
            if self._hub is None:
                self._hub = hub
                self._epoll.register(hub.fd, select.EPOLLIN)

    @classmethod
    def acquire(cls) -> Transport:
        """Returns the process's transport, creating its UCX context and worker if needed."""
        with cls._lock:
            if cls._instance is None:
                cls._instance = Transport()
            cls._users += 1
            return cls._instance

    def release(self) -> None:
        """Gives back one ``acquire``; the last one closes the endpoints and the worker."""
        with Transport._lock:
            Transport._users -= 1
            if Transport._users > 0:
                return
            Transport._instance = None
        with self._ep_lock:
            endpoints, self._endpoints = list(self._endpoints.values()), {}
        unclosed = self._close(endpoints)
        if unclosed:
            logger.warning(
                "freescale: %d UCX endpoint(s) did not close within %.0f s (a peer that does not "
                "progress UCX: dead, stopped or stuck); they are dropped",
                unclosed,
                CLOSE_S,
            )
        del endpoints
        self._epoll.close()
        with self._wake_lock:  # a late wake (a helper thread's, a CUDA watcher's) finds it gone
            os.close(self._wake_fd)
            self._wake_fd = -1
        self.worker = None
        self.context = None

    def _close(self, endpoints: list[Any]) -> int:
        """Closes ``endpoints``, progressing the worker for at most ``CLOSE_S``; returns how
        many did not close in time.

        ucxx's ``close_blocking`` bounds a close only on a worker with a progress thread of its
        own, which this one has not: it would wait for the peer for ever.
        """
        requests = [endpoint.close() for endpoint in endpoints]
        deadline = time.monotonic() + CLOSE_S
        while True:
            requests = [request for request in requests if not request.completed]
            if not requests or time.monotonic() >= deadline:
                return len(requests)
            self.worker.progress()
            time.sleep(0.001)

    def endpoint(self, address: bytes) -> Any:
        """The endpoint to the worker at ``address``, created on first use and then cached.

        Endpoint error handling stays off: it makes UCX refuse shared memory and cuda_ipc (3-5x
        slower); peer failure is detected by the backend's own heartbeats and timeouts instead.
        """
        with self._ep_lock:
            endpoint = self._endpoints.get(address)
            if endpoint is None:
                blob = self._ucx.UCXAddress.create_from_buffer(address)
                endpoint = self.worker.create_endpoint_from_worker_address(blob, False)
                self._endpoints[address] = endpoint
            return endpoint

    def send(self, endpoint: Any, buffer: Any, tag: int) -> Any:
        """Posts a tagged send of ``buffer`` (buffer protocol or CUDA array interface)."""
        return endpoint.tag_send(self._array(buffer), self._ucx.UCXXTag(tag))

    def recv(self, endpoint: Any, buffer: Any, tag: int) -> Any:
        """Posts a tagged receive into ``buffer``, matching ``tag`` exactly."""
        return endpoint.tag_recv(self._array(buffer), self._ucx.UCXXTag(tag))

    def cancel(self, requests: list[Any]) -> None:
        """Cancels the requests in ``requests`` (and empties it) while no thread progresses.

        ucxx cancels a request when its last reference goes, so the caller must hold no other
        reference to them.
        """
        with self._progress_lock:
            requests.clear()

    def info(self) -> str:
        """UCX's own description of the worker: the transports and devices it really uses."""
        return self.worker.info

    def progress(self) -> None:
        """Progresses the worker once from the calling thread (any thread; one at a time).

        Called right after posting too: a receive posted after its rendezvous message arrived
        needs one progress call to start the transfer.
        """
        with self._progress_lock:
            self.worker.progress()
        hub = self._hub
        if hub is not None:
            hub.progress()

    def wait_event(self, timeout_ms: int) -> None:
        """Progresses, then sleeps until a UCX event, a ``wake`` or ``timeout_ms`` (GIL released).

        Returns at once when arming the worker finds events already pending, so the caller
        progresses again instead of sleeping on them.
        """
        with self._progress_lock:
            self.worker.progress()
        hub = self._hub
        if hub is None:
            self._sleep(timeout_ms, None)
            return
        with hub.sleeping() as may_sleep:
            if may_sleep:
                self._sleep(timeout_ms, hub)

    def _sleep(self, timeout_ms: int, hub: Any) -> None:
        if not self.worker.arm():
            return
        for fd, _ in self._epoll.poll(timeout_ms / 1000):
            if fd == self._wake_fd:
                # Another sleeping thread may have consumed it first.
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake_fd)
            elif hub is not None and fd == hub.fd:
                hub.drain()

    def wake(self) -> None:
        """Ends a ``wait_event`` sleep now, from any thread (a no-op once released)."""
        with self._wake_lock:
            if self._wake_fd >= 0:
                os.eventfd_write(self._wake_fd, 1)
