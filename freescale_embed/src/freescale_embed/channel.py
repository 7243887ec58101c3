"""The collectives of one thread on one process group, timed and counted for telemetry.

The training thread and the prefetch thread each own their channels on their own process groups,
so their collectives never interleave on one group (which would pair up the wrong calls); a
thread's channels for device and host tensors share one group where its backend moves both.

A channel runs only AllToAll and AllGather, on tensors of one device: the collectives every
backend has and the ones the ``freescale`` backend runs itself (two ranks sharing a GPU cannot use
NCCL, which the freescale group delegates everything else to). Rows and gradients travel on the
tables' device; in prioritized mode IDs and plans travel on the host (``host_group``), so that
routing and planning never wait for a GPU busy with dense compute.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (deprecated there); 2.11 only has the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_tensor(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[world, *local.shape]``: every rank's ``local`` (one AllGather on ``group``)."""
    world = dist.get_world_size(group)
    gathered = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    _all_gather_single(gathered, local.reshape(-1).contiguous(), group=group)
    return gathered.reshape(world, *local.shape)


@dataclass
class Measured:
    """Collectives of one thread over some interval.

    Attributes:
        seconds: time spent inside them.
        bytes_sent: bytes this rank sent to other ranks.
        spans: ``(start, end)`` of each, on the system-wide monotonic clock, so that the spans of
            ranks on one host can be lined up (the benchmark's "after the last arrival" time).
    """

    seconds: float = 0.0
    bytes_sent: int = 0
    spans: list[tuple[float, float]] = field(default_factory=list)


def host_group(
    group: dist.ProcessGroup, device: torch.device, timeout: timedelta
) -> dist.ProcessGroup:
    """A group of ``group``'s ranks that moves CPU tensors: ``group`` itself if it has a backend
    for them, else (NCCL, ``"cuda:nccl"``) a new Gloo group (collective: every rank calls it)."""
    if device.type == "cpu" or _moves_cpu_tensors(group):
        return group
    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)


def _moves_cpu_tensors(group: dist.ProcessGroup) -> bool:
    try:
        group._get_backend(torch.device("cpu"))
    except RuntimeError:  # no backend for CPU tensors
        return False
    return True


class Meter:
    """Accumulates ``Measured`` until the next ``take``."""

    def __init__(self) -> None:
        self._current = Measured()

    def record(self, start: float, end: float, bytes_sent: int) -> None:
        self._current.seconds += end - start
        self._current.bytes_sent += bytes_sent
        self._current.spans.append((start, end))

    def take(self) -> Measured:
        """Returns what was measured since the last call, and starts afresh."""
        taken, self._current = self._current, Measured()
        return taken


@dataclass
class PendingAllToAll:
    """An AllToAll under way (``Channel.start_all_to_all``); its buffers live as long as it."""

    channel: Channel
    work: dist.Work
    send: torch.Tensor
    recv: torch.Tensor
    bytes_sent: int

    def wait(self) -> torch.Tensor:
        """What arrived (on CUDA: once the caller's stream has waited for it); the wait is
        measured into the channel's meter."""
        start = time.monotonic()
        self.work.wait()
        self.channel.meter.record(start, time.monotonic(), self.bytes_sent)
        return self.recv


class Channel:
    """Collectives on ``group``, each measured into ``meter`` (blocking ones from the call, a
    started AllToAll from its wait).

    Args:
        group: the process group; its ranks are the peers.
        device: where the tensors it sends and receives live.
        meter: where to measure (a new one by default; channels of one thread share theirs).
    """

    def __init__(
        self, group: dist.ProcessGroup, device: torch.device, meter: Meter | None = None
    ) -> None:
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.meter = Meter() if meter is None else meter

    def all_to_all(
        self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]
    ) -> torch.Tensor:
        """Sends ``send``'s consecutive runs of ``send_splits`` elements to ranks 0, 1, ...

        Returns:
            What arrives: runs of ``recv_splits`` elements from ranks 0, 1, ..., as one 1-D tensor.
        """
        send, recv, sent = self._buffers(send, send_splits, recv_splits)
        start = time.monotonic()
        # Blocking (not a started call waited for at once): the freescale backend then lets the
        # calling thread drive the collective itself, which saves two thread hand-offs.
        dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=recv_splits,
            input_split_sizes=send_splits,
            group=self.group,
        )
        self.meter.record(start, time.monotonic(), sent)
        return recv

    def start_all_to_all(
        self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]
    ) -> PendingAllToAll:
        """``all_to_all`` without waiting: the data moves while the caller goes on.

        Only the time spent in ``PendingAllToAll.wait`` counts as this thread's, so work done
        between the two calls hides the transfer.
        """
        send, recv, sent = self._buffers(send, send_splits, recv_splits)
        work = dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=recv_splits,
            input_split_sizes=send_splits,
            group=self.group,
            async_op=True,
        )
        return PendingAllToAll(self, work, send, recv, sent)

    def _buffers(
        self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """An AllToAll's contiguous input, its output, and the bytes it sends to other ranks."""
        recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
        own = send_splits[self.rank] if send_splits else 0
        return send.contiguous(), recv, (send.numel() - own) * send.element_size()

    def all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """``[world, *local.shape]``: every rank's ``local``."""
        start = time.monotonic()
        gathered = all_gather_tensor(local, self.group)
        sent = local.numel() * local.element_size() * (self.world_size - 1)
        self.meter.record(start, time.monotonic(), sent)
        return gathered

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's picklable ``obj`` (used only on the error path).

        Pickled bytes travel as ``all_gather`` tensors on the channel's device, not through
        ``dist.all_gather_object``, whose device choice depends on the backend.
        """
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        sizes = self.all_gather(size).flatten().tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[: data.numel()] = data
        gathered = self.all_gather(padded.to(self.device)).cpu()
        return [
            pickle.loads(gathered[rank, :length].numpy().tobytes())
            for rank, length in enumerate(sizes)
        ]
