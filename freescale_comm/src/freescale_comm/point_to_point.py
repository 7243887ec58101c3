"""Point-to-point on Gloo (``send``, ``recv``) whose waits end once the group is aborted.

Gloo's wait for a peer that stopped, hung or lost its host (no closed connection tells Gloo)
lasts until the group's timeout, 30 min by default. Its send / recv handle cannot be waited on in
steps, as ``work.DelegatedWork`` does for collectives: a wait whose limit runs out fails every
transfer of that Gloo backend ("Application timeout caused pair closure"), and the handle does
not say it is complete before a wait. That failure is what ends them here: once the group is
aborted, ``GlooBreaker`` waits 1 ms for a receive that never comes, and every pending send and
recv of the group's Gloo raises, which the handle turns into the abort's ``FreescalePeerError``.
The waits themselves stay Gloo's, in the caller's thread.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from freescale_comm.errors import FreescalePeerError

if TYPE_CHECKING:
    from freescale_comm.group import GroupContext

# The tag of the receive that breaks the Gloo backend's pairs: one no caller's send carries.
_BREAK_TAG = 2**31 - 1
_BREAK_WAIT = timedelta(milliseconds=1)


class GlooBreaker:
    """Fails every pending send and recv of a group's Gloo backend once the group is aborted:
    it is unusable after the abort anyway, and a wait on Gloo's handle ends no other way.

    Args:
        plain: the group's plain twin, whose CPU send / recv run on its Gloo backend.
        group: the group's context (its abort).
    """

    def __init__(self, plain: dist.ProcessGroup, group: GroupContext) -> None:
        self._plain = plain
        self._forget = group.on_abort(self._break)

    def close(self) -> None:
        """Forgets the abort hook, which refers back to the group."""
        self._forget()

    def _break(self) -> None:
        rank, size = self._plain.rank(), self._plain.size()
        # A receive from a peer whose connection is closed (one that failed its own pairs
        # first) fails at once, without the timeout that fails the others: each peer in turn.
        # Once one timed out, every later receive fails at once.
        for step in range(1, size):
            with contextlib.suppress(RuntimeError):
                probe = self._plain.recv([torch.empty(1)], (rank + step) % size, _BREAK_TAG)
                probe.wait(_BREAK_WAIT)


class PointToPointWork(dist.Work):
    """The handle of a ``send`` / ``recv`` the group ran on Gloo: ``wait`` returns or raises
    what Gloo's does, with the same ``timeout``, but raises a ``FreescalePeerError`` naming the
    abort's reason once the group is aborted (a peer found stopped or dead by the liveness
    thread, ``abort()``).

    Args:
        inner: Gloo's handle.
        group: the group's context (why it was aborted).
        name: what the call was (``send``, ``recv``), for the error.
    """

    def __init__(self, inner: dist.Work, group: GroupContext, name: str) -> None:
        super().__init__()
        self._inner = inner
        self._group = group
        self._name = name

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            return self._inner.wait() if timeout is None else self._inner.wait(timeout)
        except RuntimeError as err:
            reason = self._group.broken_after_gloo_failed()
            if reason is None:
                raise
            raise FreescalePeerError(
                f"rank {self._group.rank}: {self._name} on Gloo: the group was aborted by {reason}"
            ) from err

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return self._inner.source_rank()

    def _source_rank(self) -> int:
        return self._inner._source_rank()

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._inner.result()

    def synchronize(self) -> None:
        self.wait()
