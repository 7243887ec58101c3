"""Per-step measurements of the embedding communication.

A step's record is filled by the training thread (its forward and backward) and by the prefetch
thread (the lookup of its rows during the previous step, the rest of its gradient sync during
the next step), so it is final once the step after it has run its backward, or after
``ShardedEmbeddingCollection.synchronize()``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import NamedTuple

from freescale_embed.channel import Measured


class TrainingMark(NamedTuple):
    """What the training thread had added to a step's record at some point (``rewind``)."""

    exposed_comm_s: float
    prefetch_wait_s: float
    bytes_sent: int
    spans: int


@dataclass
class StepTelemetry:
    """What one training step cost in embedding communication, on this rank.

    Attributes:
        step: the optimizer step (1-based).
        lookup: how the step's rows were obtained: ``"sync"`` (looked up in its own forward),
            ``"prefetched"`` (during the previous step; the rows both steps read are updated
            in place at this step's forward), or ``"fallback"`` (the guardrail found too many
            collisions, so the previous step's backward synced all of its gradients and this
            step's forward fetched all of its rows).
        collision_pct: share of this step's unique rows (over all ranks) that the previous step
            also touched, in percent; ``None`` when not measured (sync mode, first step).
        exposed_comm_s: seconds the training thread spent in embedding collectives or waiting for
            the prefetch thread, forward and backward of this step together.
        prefetch_wait_s: the part of ``exposed_comm_s`` spent waiting for the prefetch thread.
        background_comm_s: seconds of this step's collectives on the prefetch thread (the
            deferred gradient sync, started before the next step is planned, from its wait).
        bytes_sent: bytes this rank sent during this step's calls, both threads (prioritized
            mode: the previous backward's collision gradients count in the step whose forward
            waits for them).
        prefetch_bytes: bytes held from the previous step for this one (prefetched rows and
            routing), the extra memory prioritized mode costs.
        collective_spans: ``(start, end)`` of each of the training thread's collectives of this
            step on the system-wide monotonic clock (comparable between ranks of one host).
    """

    step: int
    lookup: str = "sync"
    collision_pct: float | None = None
    exposed_comm_s: float = 0.0
    prefetch_wait_s: float = 0.0
    background_comm_s: float = 0.0
    bytes_sent: int = 0
    prefetch_bytes: int = 0
    collective_spans: list[tuple[float, float]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_exposed(self, measured: Measured) -> None:
        """Adds the training thread's collectives."""
        with self._lock:
            self.exposed_comm_s += measured.seconds
            self.bytes_sent += measured.bytes_sent
            self.collective_spans.extend(measured.spans)

    def add_wait(self, seconds: float) -> None:
        """Adds time the training thread waited for the prefetch thread."""
        with self._lock:
            self.exposed_comm_s += seconds
            self.prefetch_wait_s += seconds

    def add_background(self, measured: Measured) -> None:
        """Adds the prefetch thread's collectives."""
        with self._lock:
            self.background_comm_s += measured.seconds
            self.bytes_sent += measured.bytes_sent

    def training_mark(self) -> TrainingMark:
        """What the training thread has added so far (for ``rewind``)."""
        with self._lock:
            return TrainingMark(
                self.exposed_comm_s,
                self.prefetch_wait_s,
                self.bytes_sent,
                len(self.collective_spans),
            )

    def rewind(self, mark: TrainingMark) -> None:
        """Drops what the training thread added since ``mark`` (a step that was undone, so
        that its retry is not counted twice)."""
        with self._lock:
            self.exposed_comm_s = mark.exposed_comm_s
            self.prefetch_wait_s = mark.prefetch_wait_s
            self.bytes_sent = mark.bytes_sent
            del self.collective_spans[mark.spans :]

    def as_dict(self) -> dict[str, object]:
        with self._lock:
            return {
                "step": self.step,
                "lookup": self.lookup,
                "collision_pct": self.collision_pct,
                "exposed_comm_s": self.exposed_comm_s,
                "prefetch_wait_s": self.prefetch_wait_s,
                "background_comm_s": self.background_comm_s,
                "bytes_sent": self.bytes_sent,
                "prefetch_bytes": self.prefetch_bytes,
                "collective_spans": list(self.collective_spans),
            }
