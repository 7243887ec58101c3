"""The staged CUDA path: device bytes through pinned host chunks and UCX, pipelined.

A plan built over device buffers (the same plans as the direct path) is cut into chunks of at
most one pool slot. Every chunk then moves through three stages that run at once for different
chunks: the D2H copy of chunk i+1 (copy engine, the collective's D2H stream) while chunk i is on
the wire (UCX, host memory) while chunk i-1 is copied H2D (the H2D stream). Nothing waits for a
whole tensor, and host memory stays bounded by the group's pinned pool.

- A send chunk takes a send slot, is copied D2H, and is sent once its copy event has completed;
  a chunk sent to several peers (direct AllGather) is copied once. The slot is returned when
  every send of it has completed.
- A receive chunk takes a receive slot, is received into it, then copied H2D; a ring forward is
  sent from that same slot (no device round trip). The slot is returned when the H2D copy and
  the forwards have completed. At most two receives of a collective are posted at a time
  (``_RECV_WINDOW``): host-to-host copies run inside UCX progress calls, and the H2D copy of a
  chunk can only be queued once the call that read it returns.
- Slots are taken in one order that sender and receiver agree on — chunk index first, then the
  plan's pairwise step (or ring step) — first come first served across collectives, and send
  and receive slots come from separate halves of the pool. So the earliest unfinished message
  of all ranks always finds a slot at both ends (every slot is held by an earlier message, or by
  a received chunk whose forward is the next step of the same chunk), and no set of ranks can
  wait on each other in a circle, whatever the pool's size (a ring needs two receive slots).
  Peer-major order would not do: a chunk sent once to every peer (direct AllGather) would hold
  its slot until the peer that receives from this rank last has emptied its slots for all the
  others.

Chunk tags: a non-ring plan numbers the chunks of each (peer, direction) 1, 2, ... in plan order,
which the sender and the receiver derive alike from the same per-pair byte counts; a ring plan's
messages are already chunks (``chunk_bytes``) and keep their tags.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from freescale_comm.errors import FreescaleError
from freescale_comm.transport import MAX_SUB

if TYPE_CHECKING:
    from freescale_comm.algorithms import Plan, Transfer
    from freescale_comm.cuda import CopyStreams, CudaSupport


@dataclass(eq=False)
class _Load:
    """A device chunk copied to a host send slot once, then sent to each of its peers."""

    device: torch.Tensor
    sends: list[_Send] = field(default_factory=list)
    home: np.ndarray | None = None  # the pool slot
    slot: np.ndarray | None = None  # its first len(device) bytes
    event: torch.cuda.Event | None = None
    unsent: int = 0


@dataclass(eq=False)
class _Send:
    peer: int
    sub: int
    load: _Load | None = None  # sent from a D2H copy ...
    source: _Recv | None = None  # ... or forwarded from a received chunk (ring)
    request: Any = None


@dataclass(eq=False)
class _Recv:
    peer: int
    sub: int
    device: torch.Tensor
    forwards: list[_Send] = field(default_factory=list)
    home: np.ndarray | None = None
    slot: np.ndarray | None = None
    request: Any = None
    event: torch.cuda.Event | None = None
    unloaded: bool = False  # its H2D copy has completed
    unforwarded: int = 0


# Receives posted at once per collective. With more, one UCX progress call reads every chunk
# that has arrived (host-to-host rendezvous copies run inside progress, on the engine thread),
# and no H2D copy is queued until it returns: measured on the H200 machine, all 8 chunks of a
# 64 MiB AllToAll arrived in one 9 ms call and the pipeline ran its stages one after another
# (50% of the slowest stage's rate); two keep one chunk being read while the next is ready.
_RECV_WINDOW = 2

Post = Callable[[int, Any, int, bool], Any]


class StagedPipeline:
    """The staged data phase of one collective (see the module docstring).

    Args:
        plan: the collective's plan over CUDA byte views.
        cuda: the group's CUDA machinery (pool, watchers).
        streams: this collective's copy streams, already ordered after the caller's stream.
        post: ``post(peer, host_bytes, sub, send)`` posts a tagged UCX message, returns its
            request.
        chunk_bytes: the largest chunk (``FreescaleOptions.chunk_bytes``, the same on every
            rank, so that both sides of a pair cut it alike; a slot holds one).
        transfers: the plan's messages this pipeline moves (default: all; a peer's messages
            that travelled inside its header are left out whole, so the chunk numbering of the
            other pairs is the same on both sides).
    """

    def __init__(
        self,
        plan: Plan,
        cuda: CudaSupport,
        streams: CopyStreams,
        post: Post,
        chunk_bytes: int,
        transfers: Sequence[Transfer] | None = None,
    ) -> None:
        self._cuda = cuda
        self._pool = cuda.pool
        self._streams = streams
        self._post = post
        self._loads: list[_Load] = []
        self._recvs: list[_Recv] = []
        self._split(plan, plan.transfers if transfers is None else transfers, chunk_bytes)
        self._next_load = self._next_recv = 0
        self._loading: list[_Load] = []  # D2H enqueued, not yet sent (in stream order)
        self._sending: list[_Send] = []
        self._receiving: list[_Recv] = []
        self._unloading: list[_Recv] = []  # H2D enqueued, not yet complete (in stream order)
        self._held = 0  # slots taken and not yet given back
        self.last_d2h: torch.cuda.Event | None = None
        self._pool.enqueue(
            self, [k for k, items in (("send", self._loads), ("recv", self._recvs)) if items]
        )

    def _split(self, plan: Plan, transfers: Sequence[Transfer], chunk_bytes: int) -> None:
        count: dict[tuple[int, bool], int] = {}
        chunks_of: dict[int, list[_Recv]] = {}
        loads: dict[tuple[int, int], _Load] = {}
        order: dict[int, tuple[int, int]] = {}  # id(load or receive) -> (chunk, plan position)
        for position, transfer in enumerate(transfers):
            buffer = transfer.buffer
            size = len(buffer)
            if plan.forwarding:
                if size > self._pool.slot_bytes:
                    raise FreescaleError(
                        f"a ring message of {size} bytes does not fit a "
                        f"{self._pool.slot_bytes}-byte staging slot; raise chunk_bytes"
                    )
                pieces = [(buffer, transfer.sub, transfer.chunk)]
            else:
                key = (transfer.peer, transfer.send)
                parts = math.ceil(size / chunk_bytes)
                first = count.get(key, 0)
                count[key] = first + parts
                if count[key] > MAX_SUB - 1:
                    raise FreescaleError(
                        f"{count[key]} staging chunks for one peer exceed the tag space; raise "
                        "chunk_bytes"
                    )
                bounds = [size * c // parts for c in range(parts + 1)]
                pieces = [
                    (buffer[bounds[c] : bounds[c + 1]], 1 + first + c, c) for c in range(parts)
                ]
            if not transfer.send:
                chunks = []
                for piece, sub, c in pieces:
                    chunk = _Recv(transfer.peer, sub, piece)
                    order[id(chunk)] = (c, position)
                    chunks.append(chunk)
                chunks_of[id(transfer)] = chunks
                self._recvs.extend(chunks)
                continue
            for piece, sub, c in pieces:
                send = _Send(transfer.peer, sub)
                if transfer.after is not None:
                    source = chunks_of[id(transfer.after)][0]
                    send.source = source
                    source.forwards.append(send)
                    source.unforwarded += 1
                    continue
                key = (piece.data_ptr(), len(piece))
                load = loads.get(key)
                if load is None:
                    load = loads[key] = _Load(piece)
                    order[id(load)] = (c, position)
                    self._loads.append(load)
                load.sends.append(send)
                load.unsent += 1
                send.load = load
        self._loads.sort(key=lambda load: order[id(load)])
        self._recvs.sort(key=lambda chunk: order[id(chunk)])

    # ----------------------------------------------------------------- progress
    def advance(self) -> bool:
        """Moves every chunk as far as it can go; True if anything changed."""
        progressed = self._take_send_slots()
        progressed |= self._take_recv_slots()
        progressed |= self._send_loaded()
        progressed |= self._finish_sends()
        if self._finish_recvs():
            # Post the next receives now, not on the next call: their rendezvous requests are
            # usually waiting already, and the next progress call starts reading them.
            self._take_recv_slots()
            progressed = True
        progressed |= self._finish_unloads()
        return progressed

    def _take_send_slots(self) -> bool:
        taken = []
        while self._next_load < len(self._loads):
            slot = self._pool.take(self, "send")
            if slot is None:
                break
            load = self._loads[self._next_load]
            self._next_load += 1
            load.home, load.slot = slot, slot[: len(load.device)]
            taken.append(load)
        if self._next_load == len(self._loads):
            self._pool.leave(self, "send")
        if not taken:
            return False
        self._held += len(taken)
        # One D2H event per chunk: each chunk is sent as soon as its own copy has completed.
        for load in taken:
            load.event = self._cuda.copy(
                self._streams.d2h, [(load.slot, load.device)], self._cuda.d2h_watch
            )
            self._loading.append(load)
        self.last_d2h = taken[-1].event
        return True

    def _take_recv_slots(self) -> bool:
        progressed = False
        while self._next_recv < len(self._recvs) and len(self._receiving) < _RECV_WINDOW:
            slot = self._pool.take(self, "recv")
            if slot is None:
                break
            chunk = self._recvs[self._next_recv]
            self._next_recv += 1
            self._held += 1
            chunk.home, chunk.slot = slot, slot[: len(chunk.device)]
            chunk.request = self._post(chunk.peer, chunk.slot, chunk.sub, False)
            self._receiving.append(chunk)
            progressed = True
        if self._next_recv == len(self._recvs):
            self._pool.leave(self, "recv")
        return progressed

    def _send_loaded(self) -> bool:
        done = 0
        for load in self._loading:  # D2H events complete in stream order
            if not load.event.query():
                break
            done += 1
            for send in load.sends:
                send.request = self._post(send.peer, load.slot, send.sub, True)
                self._sending.append(send)
        self._loading = self._loading[done:]
        return done > 0

    def _finish_sends(self) -> bool:
        finished = [s for s in self._sending if s.request.completed]
        if not finished:
            return False
        for send in finished:
            _check(send.request, f"sending to rank {send.peer}")
            send.request = None
            if send.load is not None:
                send.load.unsent -= 1
                if send.load.unsent == 0:
                    self._give("send", send.load)
            else:
                # The slot goes back when both its H2D copy and its forwards are done; whichever
                # finishes second gives it.
                source = send.source
                source.unforwarded -= 1
                if source.unforwarded == 0 and source.unloaded:
                    self._give("recv", source)
        self._sending = [s for s in self._sending if s.request is not None]
        return True

    def _finish_recvs(self) -> bool:
        arrived = [r for r in self._receiving if r.request.completed]
        if not arrived:
            return False
        for chunk in arrived:
            _check(chunk.request, f"receiving from rank {chunk.peer}")
            chunk.request = None
            chunk.event = self._cuda.copy(
                self._streams.h2d, [(chunk.device, chunk.slot)], self._cuda.h2d_watch
            )
            self._unloading.append(chunk)
            for send in chunk.forwards:
                send.request = self._post(send.peer, chunk.slot, send.sub, True)
                self._sending.append(send)
        self._receiving = [r for r in self._receiving if r.request is not None]
        return True

    def _finish_unloads(self) -> bool:
        done = 0
        for chunk in self._unloading:  # H2D events complete in stream order
            if not chunk.event.query():
                break
            done += 1
            chunk.unloaded = True
            if chunk.unforwarded == 0:
                self._give("recv", chunk)
        self._unloading = self._unloading[done:]
        return done > 0

    def _give(self, kind: str, item: _Load | _Recv) -> None:
        self._pool.give(kind, item.home)
        item.home = item.slot = None
        self._held -= 1

    # ----------------------------------------------------------------- state
    @property
    def sealable(self) -> bool:
        """Every copy of the collective is enqueued (the last H2D follows the last receive)."""
        return (
            self._next_load == len(self._loads)
            and self._next_recv == len(self._recvs)
            and not self._receiving
        )

    @property
    def finished(self) -> bool:
        """Every message completed and every slot given back."""
        return self.sealable and not self._sending and not self._loading and self._held == 0

    def waiting_peers(self) -> tuple[list[int], list[int]]:
        """(peers whose data has not all arrived, peers whose sends have not completed)."""
        missing = {r.peer for r in self._recvs[self._next_recv :]}
        missing |= {r.peer for r in self._receiving}
        unsent = {s.peer for s in self._sending}
        for load in self._loads[self._next_load :] + self._loading:
            unsent |= {s.peer for s in load.sends}
        return sorted(missing), sorted(unsent)

    def cancel(self) -> list[Any]:
        """Leaves the pool's lines and hands over the requests in flight, for the caller to
        cancel (``Transport.cancel``). Slots still held are not given back: a cancelled receive
        or a copy in flight may still touch them."""
        in_flight = self._sending + self._receiving
        requests = [item.request for item in in_flight]
        for item in in_flight:
            item.request = None
        self._sending, self._receiving = [], []
        self._pool.leave(self, "send")
        self._pool.leave(self, "recv")
        return requests


def _check(request: Any, what: str) -> None:
    try:
        request.check_error()
    except Exception as err:
        raise FreescaleError(f"UCX error {what}: {err}") from err
