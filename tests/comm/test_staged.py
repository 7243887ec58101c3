"""The staged pipeline's bookkeeping, on the CPU: chunking, tags, slots, forwarding, no deadlock.

The pipelines of every rank run in one process over a loopback "wire" that matches sends to
receives by (source, destination, tag), with copies that complete at once. What the GPU adds
(real streams and events, page-locked memory) is covered by ``benchmarks/comm_gpu.py``.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from freescale_comm import algorithms
from freescale_comm.cuda import SlotPool
from freescale_comm.options import FreescaleOptions
from freescale_comm.staged import StagedPipeline


@dataclass
class _Request:
    completed: bool = False

    def check_error(self) -> None:
        pass


class _Wire:
    """Matches posted sends and receives by (source, destination, tag); copies on match."""

    def __init__(self) -> None:
        self.sends: dict[tuple[int, int, int], tuple[np.ndarray, _Request]] = {}
        self.recvs: dict[tuple[int, int, int], tuple[np.ndarray, _Request]] = {}
        self.messages = 0

    def post(self, rank: int) -> Any:
        def post(peer: int, buffer: np.ndarray, sub: int, send: bool) -> _Request:
            key = (rank, peer, sub) if send else (peer, rank, sub)
            request = _Request()
            (self.sends if send else self.recvs)[key] = (buffer.copy() if send else buffer, request)
            if key in self.sends and key in self.recvs:
                data, sent = self.sends.pop(key)
                target, received = self.recvs.pop(key)
                assert len(data) == len(target), f"tag {key}: {len(data)} vs {len(target)} bytes"
                target[:] = data
                sent.completed = received.completed = True
                self.messages += 1
            return request

        return post


class _Event:
    def query(self) -> bool:
        return True


class _Cuda:
    """Copies at once; a pool over ordinary host memory."""

    def __init__(self, pool_bytes: int, chunk_bytes: int) -> None:
        self.pool = SlotPool(np.zeros(pool_bytes, dtype=np.uint8), chunk_bytes)
        self.d2h_watch = self.h2d_watch = None

    def copy(self, stream: Any, pairs: Any, watcher: Any = None) -> _Event:
        for dst, src in pairs:
            dst = torch.from_numpy(dst) if isinstance(dst, np.ndarray) else dst
            src = torch.from_numpy(src) if isinstance(src, np.ndarray) else src
            dst.copy_(src)
        return _Event()


class _Streams:
    d2h = h2d = None


def _as_device(plan: algorithms.Plan) -> algorithms.Plan:
    """The plan's host byte views as torch tensors, standing in for CUDA bytes."""
    for transfer in plan.transfers:
        transfer.buffer = torch.from_numpy(transfer.buffer)
    return plan


def _run(plans: list[algorithms.Plan], cudas: list[_Cuda], chunk: int, seed: int = 0) -> _Wire:
    wire = _Wire()
    pipes = [
        StagedPipeline(_as_device(plan), cuda, _Streams(), wire.post(rank), chunk)
        for rank, (plan, cuda) in enumerate(zip(plans, cudas, strict=True))
    ]
    for plan in plans:
        for dst, src in plan.local_copies:
            dst[:] = src
    rng = random.Random(seed)
    for _ in range(100_000):
        if all(p.finished for p in pipes):
            return wire
        # Ranks progress in a different order every round: the result must not depend on it.
        order = rng.sample(pipes, len(pipes))
        if not any([p.advance() for p in order]):
            raise AssertionError("the pipelines stopped making progress (deadlock)")
    raise AssertionError("the pipelines did not finish")


@pytest.mark.parametrize(("n", "chunk", "pool"), [(2, 64, 256), (3, 48, 192), (4, 1000, 4000)])
def test_all_to_all_uneven_in_chunks(n, chunk, pool):
    rng = random.Random(n)
    splits = [[rng.randint(0, 50) for _ in range(n)] for _ in range(n)]
    inputs = [torch.randn(sum(splits[r]), 3) for r in range(n)]
    outputs = [torch.empty(sum(splits[j][r] for j in range(n)), 3) for r in range(n)]
    plans = [
        algorithms.all_to_all_single(
            "a2a", r, n, outputs[r], inputs[r], [splits[j][r] for j in range(n)], splits[r]
        )
        for r in range(n)
    ]
    _run(plans, [_Cuda(pool, chunk) for _ in range(n)], chunk)
    for r in range(n):
        pieces = [inputs[j].split(splits[j])[r] for j in range(n)]
        assert torch.equal(outputs[r], torch.cat(pieces))


@pytest.mark.parametrize("algorithm", ["direct", "ring"])
def test_all_gather_direct_loads_once_and_ring_forwards_from_host(algorithm):
    n, chunk = 4, 40
    options = FreescaleOptions(allgather=algorithm, chunk_bytes=chunk)
    inputs = [torch.randn(37) for _ in range(n)]
    outputs = [torch.empty(n * 37) for _ in range(n)]
    plans = [
        algorithms.all_gather_into_tensor("ag", r, n, [outputs[r]], [inputs[r]], options)
        for r in range(n)
    ]
    assert plans[0].forwarding == (algorithm == "ring")
    cudas = [_Cuda(4 * chunk, chunk) for _ in range(n)]  # the smallest pool: 2 slots of each
    wire = _run(plans, cudas, chunk)
    for r in range(n):
        assert torch.equal(outputs[r], torch.cat(inputs))
    chunks = -(-37 * 4 // chunk)  # of one rank's 148 bytes
    assert wire.messages == n * (n - 1) * chunks


@pytest.mark.parametrize("seed", range(10))
def test_all_gather_any_size_with_the_smallest_pool(seed):
    rng = random.Random(seed)
    n, chunk = rng.randint(2, 5), rng.choice([8, 24, 64])
    options = FreescaleOptions(allgather=rng.choice(["direct", "ring"]), chunk_bytes=chunk)
    size = rng.randint(1, 60)
    inputs = [torch.randn(size) for _ in range(n)]
    outputs = [torch.empty(n * size) for _ in range(n)]
    plans = [
        algorithms.all_gather_into_tensor("ag", r, n, [outputs[r]], [inputs[r]], options)
        for r in range(n)
    ]
    _run(plans, [_Cuda(4 * chunk, chunk) for _ in range(n)], chunk, seed)
    for r in range(n):
        assert torch.equal(outputs[r], torch.cat(inputs))


def test_collectives_in_flight_share_the_pool_first_come_first_served():
    n, chunk = 3, 32
    cudas = [_Cuda(4 * 32, chunk) for _ in range(n)]
    wire = _Wire()
    rounds = []
    for seed in range(3):
        inputs = [
            torch.randn(n * 20, generator=torch.Generator().manual_seed(seed * 10 + r))
            for r in range(n)
        ]
        outputs = [torch.empty(n * 20) for _ in range(n)]
        plans = [
            _as_device(algorithms.all_to_all_single("a2a", r, n, outputs[r], inputs[r], [], []))
            for r in range(n)
        ]
        for plan in plans:
            for dst, src in plan.local_copies:
                dst[:] = src
        pipes = [
            StagedPipeline(plans[r], cudas[r], _Streams(), _tagged(wire, r, seed), chunk)
            for r in range(n)
        ]
        rounds.append((inputs, outputs, pipes))
    all_pipes = [p for _, _, pipes in rounds for p in pipes]
    # Advance the ranks in a scrambled order: progress must not depend on it.
    order = list(itertools.product(range(len(rounds)), range(n)))
    random.Random(7).shuffle(order)
    for _ in range(10_000):
        if all(p.finished for p in all_pipes):
            break
        if not any([rounds[k][2][r].advance() for k, r in order]):
            raise AssertionError("deadlock")
    for inputs, outputs, _ in rounds:
        for r in range(n):
            want = torch.cat([inputs[j].view(n, -1)[r] for j in range(n)])
            assert torch.equal(outputs[r], want)


def _tagged(wire: _Wire, rank: int, seq: int) -> Any:
    """A post function whose tags also carry the collective (as the real tags do)."""
    post = wire.post(rank)
    return lambda peer, buffer, sub, send: post(peer, buffer, seq * 100_000 + sub, send)


def test_at_most_two_receives_of_a_collective_are_posted_at_once():
    # More would let one UCX progress call read every arrived chunk before any H2D is queued.
    n, chunk = 3, 16
    wire = _Wire()
    pending: dict[int, list[_Request]] = {r: [] for r in range(n)}
    most = 0

    def counted(rank: int) -> Any:
        post = wire.post(rank)

        def post_counted(peer: int, buffer: np.ndarray, sub: int, send: bool) -> _Request:
            nonlocal most
            request = post(peer, buffer, sub, send)
            if not send:
                pending[rank] = [r for r in pending[rank] if not r.completed] + [request]
                most = max(most, sum(not r.completed for r in pending[rank]))
            return request

        return post_counted

    inputs = [torch.randn(n * 40) for _ in range(n)]
    outputs = [torch.empty(n * 40) for _ in range(n)]
    plans = [
        _as_device(algorithms.all_to_all_single("a2a", r, n, outputs[r], inputs[r], [], []))
        for r in range(n)
    ]
    for plan in plans:
        for dst, src in plan.local_copies:
            dst[:] = src
    pipes = [
        StagedPipeline(plans[r], _Cuda(64 * chunk, chunk), _Streams(), counted(r), chunk)
        for r in range(n)
    ]
    for _ in range(10_000):
        if all(p.finished for p in pipes):
            break
        if not any([p.advance() for p in pipes]):
            raise AssertionError("deadlock")
    assert 1 < most <= 2
    for r in range(n):
        assert torch.equal(outputs[r], torch.cat([inputs[j].view(n, -1)[r] for j in range(n)]))
