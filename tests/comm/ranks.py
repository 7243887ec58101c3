"""Functions the test ranks run (importable by module path, as ``LocalGroup.run`` needs).

Every rank can rebuild every other rank's input from (seed, case, rank), so each collective is
checked against the result computed locally, for every dtype, and also against Gloo's result in
the same processes where Gloo takes the dtype.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
import itertools
import logging
import os
import random
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]
# Gloo's AllGather / AllToAll reject these.
_NOT_GLOO = {torch.complex64, torch.bool, torch.int16}
_GLOO: dict[str, Any] = {}


def gloo_group() -> Any:
    """A Gloo group over the same ranks (made once per process; every rank must call it)."""
    if "world" not in _GLOO:
        _GLOO["world"] = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    return _GLOO["world"]


def freescale_group(timeout_s: float, **options: Any) -> Any:
    """A new freescale group of every rank with ``FreescaleOptions(**options)``."""
    from freescale_comm import FreescaleOptions

    return dist.new_group(
        backend="freescale",
        timeout=timedelta(seconds=timeout_s),
        pg_options=FreescaleOptions(**options),
    )


def cuda_group(
    timeout_s: float = 60, host: str | None = None, **options: Any
) -> tuple[torch.device, Any]:
    """This rank's GPU (GPU rank % device count), made current, and a new freescale group
    with ``FreescaleOptions(**options)``; ``host``: the host identity the group sees."""
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    with _pretend_host(host):
        group = freescale_group(timeout_s, **options)
    return device, group


@contextlib.contextmanager
def _pretend_host(host: str | None) -> Iterator[None]:
    """The host identity groups made meanwhile see (None: the one set before)."""
    if host is None:
        yield
        return
    before = os.environ.get("FREESCALE_HOST_ID")
    os.environ["FREESCALE_HOST_ID"] = host
    try:
        yield
    finally:
        if before is None:
            del os.environ["FREESCALE_HOST_ID"]
        else:
            os.environ["FREESCALE_HOST_ID"] = before


def make_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    low = 0 if dtype == torch.uint8 else -100
    return torch.randint(low, 100, shape, generator=gen).to(dtype)


def _maybe_strided(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """The same values, sometimes as a non-contiguous view (UCX must not see its strides)."""
    if t.dim() >= 2 and t.numel() > 1 and rng.random() < 0.3:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    return t


def _empty_maybe_strided(shape: tuple[int, ...], dtype: torch.dtype, rng: random.Random):
    if len(shape) >= 2 and rng.random() < 0.3:
        return torch.empty((shape[1], shape[0], *shape[2:]), dtype=dtype).transpose(0, 1)
    return torch.empty(shape, dtype=dtype)


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.shape != want.shape or not torch.equal(got.contiguous(), want.contiguous()):
        raise AssertionError(f"{what}: got {got.flatten()[:8]} want {want.flatten()[:8]}")


def _tensor_seed(seed: int, case: int, rank: int, part: int = 0) -> int:
    """Seed of ``rank``'s input ``part`` in ``case`` of a run seeded ``seed``."""
    return seed * 1_000_003 + case * 1009 + rank * 31 + part


def run_random_cases(
    seed: int, cases: int, compare_gloo: bool = True, group: Any = None, scale: int = 1
) -> int:
    """Random AllGather / AllToAll cases (shapes, dtypes, splits, strides) on ``group`` (the
    world by default, whose ranks it must have), row counts times ``scale``; returns the
    count."""
    rank, n = dist.get_rank(), dist.get_world_size()
    gloo = gloo_group() if compare_gloo else None
    for case in range(cases):
        rng = random.Random(seed * 7919 + case)
        dtype = rng.choice(DTYPES)
        kind = rng.choice(
            ["ag_tensor", "ag_list", "a2a_even", "a2a_uneven", "a2a_list", "ag_coalesced"]
        )
        rest = tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 2)))

        seed_of = functools.partial(_tensor_seed, seed, case)
        what = f"case {case} {kind} {dtype} rest={rest}"
        if kind in ("ag_tensor", "ag_list"):
            rows = rng.randint(0, 4) * scale
            inputs = [make_tensor((rows, *rest), dtype, seed_of(r)) for r in range(n)]
            mine = _maybe_strided(inputs[rank], rng)
            if kind == "ag_tensor":
                stacked = rng.random() < 0.5
                shape = (n, rows, *rest) if stacked else (n * rows, *rest)
                out = _empty_maybe_strided(shape, dtype, rng)
                dist.all_gather_into_tensor(out, mine, group=group)
                want = torch.stack(inputs) if stacked else torch.cat(inputs)
                _same(out, want, what)
                if gloo is not None and dtype not in _NOT_GLOO:
                    # Gloo takes only the concatenated output shape.
                    ref = torch.empty((n * rows, *rest), dtype=dtype)
                    dist.all_gather_into_tensor(ref, mine.contiguous(), group=gloo)
                    _same(out.reshape(ref.shape), ref, what + " vs gloo")
            else:
                outs = [_empty_maybe_strided((rows, *rest), dtype, rng) for _ in range(n)]
                dist.all_gather(outs, mine, group=group)
                for r in range(n):
                    _same(outs[r], inputs[r], f"{what} slot {r}")
                if gloo is not None and dtype not in _NOT_GLOO:
                    refs = [torch.empty((rows, *rest), dtype=dtype) for _ in range(n)]
                    dist.all_gather(refs, mine.contiguous(), group=gloo)
                    for r in range(n):
                        _same(outs[r], refs[r], f"{what} slot {r} vs gloo")
        elif kind == "ag_coalesced":
            k = rng.randint(1, 3)
            rows = [rng.randint(0, 3) * scale for _ in range(k)]
            inputs = [
                [make_tensor((rows[i], *rest), dtype, seed_of(r, i)) for i in range(k)]
                for r in range(n)
            ]
            outs = [torch.empty((n * rows[i], *rest), dtype=dtype) for i in range(k)]
            pg = group or dist.group.WORLD
            pg.allgather_into_tensor_coalesced(outs, inputs[rank]).wait()
            for i in range(k):
                _same(outs[i], torch.cat([inputs[r][i] for r in range(n)]), f"{what} #{i}")
        else:
            if kind == "a2a_even":
                per = rng.randint(0, 3) * scale
                splits = [[per] * n for _ in range(n)]
            else:
                splits = [[rng.randint(0, 3) * scale for _ in range(n)] for _ in range(n)]
            # inputs[r][j]: the rows rank r sends to rank j.
            inputs = [
                [make_tensor((splits[r][j], *rest), dtype, seed_of(r, j)) for j in range(n)]
                for r in range(n)
            ]
            send = [splits[rank][j] for j in range(n)]
            recv = [splits[j][rank] for j in range(n)]
            want = [inputs[j][rank] for j in range(n)]
            if kind == "a2a_list":
                outs = [_empty_maybe_strided((recv[j], *rest), dtype, rng) for j in range(n)]
                ins = [_maybe_strided(t, rng) for t in inputs[rank]]
                dist.all_to_all(outs, ins, group=group)
                for j in range(n):
                    _same(outs[j], want[j], f"{what} from {j}")
            else:
                flat_in = _maybe_strided(torch.cat(inputs[rank]), rng)
                out = torch.empty((sum(recv), *rest), dtype=dtype)
                even = kind == "a2a_even"
                dist.all_to_all_single(
                    out, flat_in, None if even else recv, None if even else send, group=group
                )
                _same(out, torch.cat(want), what)
                if gloo is not None and dtype not in _NOT_GLOO:
                    ref = torch.empty_like(out)
                    dist.all_to_all_single(ref, flat_in.contiguous(), recv, send, group=gloo)
                    _same(out, ref, what + " vs gloo")
    return cases


def concurrent_random_cases(
    seed: int, rounds: int, threads: int, max_elements: int, hosts: int = 1
) -> int:
    """Collectives in flight at once from several threads, checked against local results.

    Each round a thread issues 1-6 async AllGathers and AllToAlls on one of its groups and waits
    for them in a random order, some through a ``then`` callback. Each thread has groups of its
    own (a group's collectives must start in one order on every rank, so no two threads share
    one): one of every rank and, with more than 2 ranks, one of the ranks of its parity.

    Args:
        seed: seeds the draws, which are the same on every rank.
        rounds: rounds per thread.
        threads: threads per rank.
        max_elements: the largest AllGather piece per rank; AllToAll splits are drawn around
            it divided among the peers, so a rank may send up to about twice it.
        hosts: pretend hosts the ranks are spread over (``FREESCALE_HOST_ID``).

    Returns:
        The collectives checked on this rank.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    halves = [list(range(parity, n, 2)) for parity in (0, 1)] if n > 2 else []
    groups: list[list[tuple[Any, list[int]]]] = []
    with _pretend_host(f"soak-host-{rank * hosts // n}" if hosts > 1 else None):
        for _ in range(threads):
            mine = [(freescale_group(60), list(range(n)))]
            for members in halves:  # every rank makes both
                half = dist.new_group(members, backend="freescale", timeout=timedelta(seconds=60))
                if rank in members:
                    mine.append((half, members))
            groups.append(mine)
    sizes = sorted({0, 1, 7, 2049, 16_400, 70_000, 300_000, max_elements})
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]
    checked = [0] * threads
    failures: list[str] = []

    def issue(
        group: Any, members: list[int], rng: random.Random, case: int
    ) -> tuple[Any, torch.Tensor, Any, str]:
        size, me = len(members), members.index(rank)
        dtype = rng.choice(dtypes)
        elements = rng.choice(sizes)
        what = f"case {case} on {members} {dtype} {elements}"
        seed_of = functools.partial(_tensor_seed, seed, case)
        if rng.random() < 0.5:
            inputs = [make_tensor((elements,), dtype, seed_of(r)) for r in range(size)]
            out = torch.empty(size * elements, dtype=dtype)
            work = dist.all_gather_into_tensor(out, inputs[me], group=group, async_op=True)
            return work, out, torch.cat(inputs), "all_gather " + what
        # splits[r][j]: the elements member r sends to member j, around elements / size each
        # (n x n draws of one number each whatever the group's size, so that the draws of
        # ranks in groups of different sizes stay alike).
        most = 2 * elements // size + 1
        grid = [[int(rng.random() * (most + 1)) for _ in range(n)] for _ in range(n)]
        splits = [row[:size] for row in grid[:size]]
        inputs = [
            [make_tensor((splits[r][j],), dtype, seed_of(r, j)) for j in range(size)]
            for r in range(size)
        ]
        recv = [splits[j][me] for j in range(size)]
        out = torch.empty(sum(recv), dtype=dtype)
        work = dist.all_to_all_single(
            out, torch.cat(inputs[me]), recv, splits[me], group=group, async_op=True
        )
        return work, out, torch.cat([inputs[j][me] for j in range(size)]), "all_to_all " + what

    def worker(index: int) -> None:
        rng = random.Random(seed * 101 + index)  # the same draws on every rank
        case = index << 20
        try:
            for _ in range(rounds):
                # Every rank draws the same choice; a half group is the one of this rank's parity.
                group, members = groups[index][rng.randrange(len(groups[index]))]
                in_flight = []
                for _ in range(rng.randint(1, 6)):
                    in_flight.append(issue(group, members, rng, case))
                    case += 1
                rng.shuffle(in_flight)
                for work, out, want, what in in_flight:
                    if rng.random() < 0.3:
                        # [output], or the ranks' pieces of an AllGather's (Gloo's form)
                        out = work.get_future().then(lambda f: torch.cat(f.value())).wait()
                    else:
                        work.wait()
                    _same(out, want, what)
                    checked[index] += 1
        except Exception as err:
            failures.append(f"thread {index}: {type(err).__name__}: {err}")

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    if failures:
        raise AssertionError("; ".join(failures))
    for group, _ in itertools.chain(*groups):
        dist.destroy_process_group(group)
    return sum(checked)


def delegated_ops() -> list[float]:
    """Collectives the backend hands to Gloo: all_reduce, broadcast, reduce_scatter, barrier
    (also one asked for a CUDA device, as ``dist.barrier`` asks wherever CUDA exists: on Gloo
    too, not on NCCL), reduce, and a ring of point-to-point messages in which rank 0 comes
    0.3 s late, so that its successor's receive and its predecessor's send wait for it (a
    wait with a limit that runs out fails Gloo's send and recv), a receive from any source and
    a batch of sends and receives."""
    rank, n = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=n - 1)
    dist.barrier()
    options = dist.BarrierOptions()
    options.device = torch.device("cuda", 0)
    dist.group.WORLD.barrier(opts=options).wait()
    rs = torch.empty(1)
    dist.reduce_scatter_tensor(rs, torch.arange(n, dtype=torch.float32))
    reduced = torch.tensor([1.0])
    dist.reduce(reduced, dst=0)
    received = torch.empty(1)
    if rank == 0:
        time.sleep(0.3)
    receive = dist.irecv(received, src=(rank - 1) % n)
    dist.send(torch.tensor([float(rank)]), dst=(rank + 1) % n)
    receive.wait()
    # A receive from any source names its sender (the handle's source rank), and a batch of
    # sends and receives is waited on handle by handle.
    sender = -1
    if rank == 0:
        sender = dist.recv(torch.empty(1))
    elif rank == n - 1:
        dist.send(torch.tensor([1.0]), dst=0)
    batched = torch.empty(1)
    ops = [
        dist.P2POp(dist.isend, torch.tensor([float(rank)]), (rank + 1) % n),
        dist.P2POp(dist.irecv, batched, (rank - 1) % n),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if sender not in (-1, n - 1) or batched.item() != received.item():
        raise AssertionError(f"recv from any source: {sender}, batched: {batched.item()}")
    return [t.item(), b.item(), rs.item(), reduced.item() if rank == 0 else 0.0, received.item()]


def delegated_ops_back_to_back(rounds: int) -> int:
    """Delegated collectives issued back to back, their tensors kept alive; returns ``rounds``.

    Each call comes while Gloo's worker may still be freeing the previous one's work (which
    takes the GIL for the tensors' Python objects, under the lock the next call takes): a call
    that entered Gloo holding the GIL deadlocked here within a few hundred rounds.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    for _ in range(rounds):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        b = torch.tensor([float(rank)])
        dist.broadcast(b, src=n - 1)
        dist.barrier()
        if t.item() != n * (n + 1) / 2 or b.item() != n - 1:
            raise AssertionError(f"all_reduce gave {t.item()}, broadcast {b.item()}")
    return rounds


def in_place_all_gather(elements: int) -> bool:
    """all_gather_into_tensor whose input is this rank's slot of the output (FSDP's call)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.full((n * elements,), -1.0)
    mine = out.view(n, elements)[rank]
    mine.copy_(torch.arange(elements, dtype=torch.float32) + 1000 * rank)
    dist.all_gather_into_tensor(out, mine)
    want = torch.cat([torch.arange(elements, dtype=torch.float32) + 1000 * r for r in range(n)])
    _same(out, want, "in-place all_gather_into_tensor")
    return True


def nested_future_collectives(rounds: int, cuda_path: str | None = None) -> int:
    """Two AllGathers in flight, each future's callback starting an AllToAll of its own size
    and waiting for its future: the callbacks run one at a time in the order attached (a
    done future's at once, in ``then``), the same on every rank, so the nested calls pair
    up. On CUDA tensors over a group forced to ``cuda_path`` when given, else on the CPU
    (world group). Returns the checked results."""
    rank, n = dist.get_rank(), dist.get_world_size()
    device, group = torch.device("cpu"), None
    if cuda_path is not None:
        device, group = cuda_group(cuda_path=cuda_path)

    def then_all_to_all(gathered: torch.Tensor, per_peer: int) -> Any:
        def callback(fut: torch.futures.Future) -> torch.Tensor:
            fut.wait()
            moved = torch.empty(n * per_peer, device=device)
            source = gathered[:1].repeat(n * per_peer) + torch.arange(n * per_peer, device=device)
            work = dist.all_to_all_single(moved, source, group=group, async_op=True)
            work.get_future().wait()
            return moved

        return callback

    checked = 0
    for i in range(rounds):
        # Both calls first: this thread starts no collective while callbacks may.
        gathered = [torch.empty(n, device=device) for _ in range(2)]
        futures = [
            dist.all_gather_into_tensor(
                out,
                torch.full((1,), float(100 * i + 10 * k + rank), device=device),
                group=group,
                async_op=True,
            ).get_future()
            for k, out in enumerate(gathered)
        ]
        chained, wants = [], []
        for k, per_peer in enumerate((3, 5)):
            chained.append(futures[k].then(then_all_to_all(gathered[k], per_peer)))
            # Each peer sent its first gathered value (rank 0's) plus its own offsets.
            offsets = torch.arange(rank * per_peer, (rank + 1) * per_peer, device=device)
            wants.append((100 * i + 10 * k + offsets).float().repeat(n))
        for future, want in zip(chained, wants, strict=True):
            _same(future.wait(), want, f"nested AllToAll of round {i}")
            checked += 1
    if group is not None:
        torch.cuda.synchronize()
        dist.destroy_process_group(group)
    return checked


def overlapping_inputs(elements: int, cuda_path: str | None = None) -> list[str]:
    """AllToAlls whose input is their output, and an AllGather whose input overlaps a slot that
    receives a peer's piece: every result as if the input had been copied first. On CUDA
    tensors over a group forced to ``cuda_path`` when given, else on the CPU (world group)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    device, group = torch.device("cpu"), None
    if cuda_path is not None:
        device, group = cuda_group(cuda_path=cuda_path)

    def values(sender: int, peer: int) -> torch.Tensor:
        return torch.arange(elements, dtype=torch.float32, device=device) + 1e4 * sender + peer

    checked = []
    both = torch.cat([values(rank, p) for p in range(n)])
    dist.all_to_all_single(both, both, group=group)
    _same(both, torch.cat([values(p, rank) for p in range(n)]), "in-place all_to_all_single")
    checked.append("all_to_all_single")
    pieces = [values(rank, p) for p in range(n)]
    dist.all_to_all(pieces, pieces, group=group)
    for p in range(n):
        _same(pieces[p], values(p, rank), "in-place all_to_all")
    checked.append("all_to_all")
    out = torch.full((n * elements,), -1.0, device=device)
    first = out[:elements]  # every rank's input is slot 0, which receives rank 0's piece
    first.copy_(values(rank, 0))
    dist.all_gather_into_tensor(out, first, group=group)
    _same(out, torch.cat([values(p, 0) for p in range(n)]), "overlapping all_gather_into_tensor")
    checked.append("all_gather_into_tensor")
    if group is not None:
        torch.cuda.synchronize()
        dist.destroy_process_group(group)
    return checked


def subgroups() -> list[float]:
    """new_group / new_subgroups of the freescale backend, overlapping groups included."""
    rank, n = dist.get_rank(), dist.get_world_size()
    timeout = timedelta(seconds=30)
    pair = dist.new_group([0, 1], backend="freescale", timeout=timeout)
    tail = dist.new_group(list(range(1, n)), backend="freescale", timeout=timeout)
    results = []
    if rank in (0, 1):
        out = torch.empty(2)
        dist.all_gather_into_tensor(out, torch.tensor([float(rank)]), group=pair)
        results.append(out.sum().item())
    if rank >= 1:
        out = torch.empty(n - 1)
        dist.all_gather_into_tensor(out, torch.tensor([float(rank)]), group=tail)
        results.append(out.sum().item())
    sub, _ = dist.new_subgroups(group_size=2, backend="freescale", timeout=timeout)
    x = torch.tensor([float(rank)] * 2)
    out = torch.empty(2)
    dist.all_to_all_single(out, x, group=sub)
    results.append(out.sum().item())
    for group in (pair, tail, sub):
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)
    return results


def device_mesh() -> list[Any]:
    """A 2 x 2 DeviceMesh over a freescale world: its dimension groups are freescale groups."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    backends = [dist.get_backend(mesh.get_group(dim)) for dim in ("dp", "tp")]
    x = torch.tensor([float(rank), 10.0 * rank])
    tp_rows = funcol.all_gather_tensor(x, 0, (mesh, 1))  # "tp": ranks 2k, 2k+1
    y = torch.arange(4, dtype=torch.float32) + 100 * rank
    dp_moved = funcol.all_to_all_single(y, None, None, (mesh, 0))  # "dp": ranks j, j+2
    out = torch.empty(4)
    dist.all_gather_into_tensor(out, x, group=mesh.get_group("dp"))
    return [*backends, tp_rows.tolist(), dp_moved.tolist(), out.tolist()]


def async_ops(rounds: int) -> bool:
    """Several collectives in flight at once, waited out of order, and through futures."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for i in range(rounds):
        works, checks = [], []
        for k in range(4):
            x = torch.full((1000 + k,), float(rank * 10 + k + i))
            out = torch.empty(n * (1000 + k))
            works.append(dist.all_gather_into_tensor(out, x, async_op=True))
            want = torch.cat([torch.full((1000 + k,), float(r * 10 + k + i)) for r in range(n)])
            checks.append((out, want))
            a = torch.arange(n * 3, dtype=torch.float64) + rank
            b = torch.empty_like(a)
            works.append(dist.all_to_all_single(b, a, async_op=True))
            want_b = torch.cat(
                [torch.arange(rank * 3, rank * 3 + 3, dtype=torch.float64) + r for r in range(n)]
            )
            checks.append((b, want_b))
        futures = [w.get_future() for w in works[::2]]
        for work in reversed(works[1::2]):
            assert work.wait()
        for fut in futures:
            fut.wait()
        assert all(w.is_completed() for w in works)
        for got, want in checks:
            _same(got, want, f"async round {i}")
    return True


def a_thread_preempted_before_its_start(elements: int) -> dict[str, list[float]]:
    """Rank 0 calls two AllGathers from two threads, the first preempted inside the backend
    before its collective starts (a sleep standing in for the scheduler), so the second
    starts first; the other ranks call both from one thread. Any pairing is right (the calls
    have one shape), a hang is not: returns each call's gathered values by thread."""
    from freescale_comm import group as group_module

    rank, n = dist.get_rank(), dist.get_world_size()
    gathered: dict[str, list[float]] = {}

    def call(name: str) -> None:
        out = torch.empty(n * elements)
        dist.all_gather_into_tensor(out, torch.full((elements,), float(rank)))
        gathered[name] = out.view(n, elements)[:, -1].tolist()

    if rank != 0:
        call("first")
        call("second")
        return gathered
    launch = group_module.GroupContext.launch
    preempted = threading.Event()

    def preempted_once(self: Any, op: Any, caller_waits: bool) -> None:
        if not preempted.is_set():
            preempted.set()
            time.sleep(0.5)
        launch(self, op, caller_waits)

    with mock.patch.object(group_module.GroupContext, "launch", preempted_once):
        first = threading.Thread(target=call, args=("first",))
        first.start()
        preempted.wait(10)
        call("second")
        first.join(120)
    return gathered


def a_launch_beside_an_express_poll(late_s: float) -> dict[str, Any]:
    """Rank 0 calls a small AllToAll on one thread, which the express path runs in its call,
    polling for its peers' headers while it holds the group's launch lock (for up to 30 s
    here: ``idle_wait=yield`` with ``engine.YIELD_S`` raised), and once that one has written
    its headers starts a second one from another thread; the other ranks call both ``late_s``
    late. Returns how long rank 0's second call took to return its handle (``started_after_s``)
    and both results."""
    from freescale_comm import engine

    rank, n = dist.get_rank(), dist.get_world_size()
    with mock.patch.object(engine, "YIELD_S", 30.0):
        group = freescale_group(60, idle_wait="yield")
    x = torch.full((n,), float(rank))
    first, second = torch.empty(n), torch.empty(n)
    started_after_s = 0.0
    if rank == 0:
        boxes = group._ctx.outboxes
        posted = boxes.posted
        caller = threading.Thread(target=dist.all_to_all_single, args=(first, x, None, None, group))
        caller.start()
        deadline = time.monotonic() + 10
        while boxes.posted == posted and time.monotonic() < deadline:  # now in its poll
            time.sleep(0.001)
        time.sleep(0.05)
        began = time.monotonic()
        work = dist.all_to_all_single(second, x + 10, group=group, async_op=True)
        started_after_s = time.monotonic() - began
        work.wait()
        caller.join(60)
    else:
        time.sleep(late_s)
        works = [
            dist.all_to_all_single(out, x + shift, group=group, async_op=True)
            for out, shift in ((first, 0), (second, 10))
        ]
        for work in works:
            work.wait()
    dist.destroy_process_group(group)
    return {
        "started_after_s": started_after_s,
        "first": first.tolist(),
        "second": second.tolist(),
    }


def all_gather_single_is_own() -> tuple[bool, list[str]]:
    """``dist.all_gather_single`` (torch 2.13's name for ``all_gather_into_tensor``): whether it
    gathered every rank's piece, and the own collectives it ran (none: it went to Gloo)."""
    from freescale_comm import process_group

    own = process_group.ProcessGroupFreescale._own
    ran: list[str] = []

    def recording(self: Any, plan: Any, opts: Any) -> Any:
        ran.append(plan.signature.op)
        return own(self, plan, opts)

    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.empty(n * 3)
    with mock.patch.object(process_group.ProcessGroupFreescale, "_own", recording):
        dist.all_gather_single(out, torch.full((3,), float(rank)))
    return torch.equal(out, torch.arange(n).float().repeat_interleave(3)), ran


def functional_and_compile(use_compile: bool) -> list[float]:
    """Functional collectives (they reach the coalesced entry points) and torch.compile."""
    import torch.distributed._functional_collectives as funcol

    rank, n = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    x = torch.arange(4, dtype=torch.float32) + 10 * rank
    gathered = funcol.all_gather_tensor(x, 0, group)
    want = torch.cat([torch.arange(4, dtype=torch.float32) + 10 * r for r in range(n)])
    _same(gathered, want, "funcol.all_gather_tensor")
    y = torch.arange(2 * n, dtype=torch.float32) + 100 * rank
    moved = funcol.all_to_all_single(y, None, None, group)
    want_y = torch.cat(
        [torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * r for r in range(n)]
    )
    _same(moved, want_y, "funcol.all_to_all_single")
    out = [gathered.sum().item(), moved.sum().item()]
    if use_compile:

        def step(t: torch.Tensor) -> torch.Tensor:
            return funcol.all_gather_tensor(t * 2, 0, group).sum()

        compiled = torch.compile(step, backend="eager", fullgraph=True)
        out.append(compiled(x).item())
    return out


def _gather_mean_hook(group, bucket):
    """A DDP comm hook shaped like torch's quantization hooks (which fail on Gloo in torch
    2.13): the mean gradient from two AllGathers, the second started and waited for inside the
    first one's future callback."""
    grad = bucket.buffer()
    n = dist.get_world_size(group)
    scales = torch.empty(n, dtype=grad.dtype)
    first = dist.all_gather_into_tensor(
        scales, grad.abs().max().reshape(1), group=group, async_op=True
    )

    def gather_scaled(fut: torch.futures.Future) -> torch.Tensor:
        fut.wait()
        scale = scales.max().clamp_min(1e-12)
        gathered = torch.empty(n * grad.numel(), dtype=grad.dtype)
        second = dist.all_gather_into_tensor(gathered, grad / scale, group=group, async_op=True)
        second.get_future().wait()
        return gathered.view(n, -1).sum(0) * (scale / n)

    return first.get_future().then(gather_scaled)


def ctrl_c_while_ddp_waits() -> str:
    """Rank 0 runs a DDP backward and, while its reducer waits (in C++) for the AllReduce that
    rank 1 starts only 0.6 s later, gets a SIGINT, as from Ctrl-C. Returns the type of what
    rank 0's step raised (rank 1: "none"); both steps complete."""
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(8, 1))
    dist.barrier()
    if rank != 0:
        time.sleep(0.6)
        ddp(torch.ones(2, 8)).sum().backward()
        return "none"
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        ddp(torch.ones(2, 8)).sum().backward()
        time.sleep(1.0)  # where a SIGINT still pending is raised, if none was
    except BaseException as err:  # what the user's handler would see
        return type(err).__name__
    return "none"


def ddp_train(backend: str, steps: int, hook: str | None = None) -> list[float]:
    """A few DDP steps on a small model over ``backend`` (world group or a Gloo group), with
    DDP's default all-reduce or, with ``hook="gather_mean"``, a comm hook whose future
    callback starts another AllGather and waits for it."""
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 8), torch.nn.Flatten(), torch.nn.Linear(32, 4)
    )
    group = None if backend == "freescale" else gloo_group()
    # With a hook, one bucket: the hooks of several start collectives from the autograd thread
    # while the callbacks of earlier ones start theirs, in an order that differs between ranks
    # (on Gloo as well).
    bucket_cap_mb = 0.001 if hook is None else 25
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_cap_mb)
    if hook == "gather_mean":
        ddp.register_comm_hook(group, _gather_mean_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        ids = torch.randint(0, 50, (6, 4), generator=gen)
        loss = ddp(ids).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [float(p.double().sum()) for p in model.parameters()]


def bad_inputs() -> list[str]:
    """Mismatched inputs fail on every rank with the same clear error; the group stays usable."""
    from freescale_comm import FreescaleValidationError

    rank, n = dist.get_rank(), dist.get_world_size()
    messages = []

    def expect(fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except FreescaleValidationError as err:
            messages.append(str(err))
            return
        raise AssertionError(f"{fn.__name__} accepted bad input")

    # Sizes that differ across ranks.
    size = 2 + (rank == 1)
    expect(dist.all_gather_into_tensor, torch.empty(n * size), torch.ones(size))
    # Dtypes that differ across ranks.
    dtype = torch.float64 if rank == 0 else torch.float32
    expect(dist.all_gather_into_tensor, torch.empty(n * 2, dtype=dtype), torch.ones(2, dtype=dtype))
    # Output of the wrong size on one rank only (a local error every rank must hear about).
    expect(dist.all_gather_into_tensor, torch.empty(n * 2 + (rank == 0)), torch.ones(2))
    # Uneven splits that disagree across ranks.
    splits = [1] * n
    if rank == 0:
        splits[1] = 2
    expect(dist.all_to_all_single, torch.empty(n), torch.ones(sum(splits)), [1] * n, splits)
    # Splits that do not add up to the input.
    expect(dist.all_to_all_single, torch.empty(n), torch.ones(n), [1] * n, [2] * n)
    # A list all_to_all with a wrong-sized output somewhere.
    outs = [torch.empty(1 + (rank == n - 1 and j == 0)) for j in range(n)]
    expect(dist.all_to_all, outs, [torch.ones(1) for _ in range(n)])
    # A coalesced AllGather whose per-rank total agrees but splits into tensors differently
    # (small enough to travel inside the header, where it would be cut at the wrong place).
    sizes = (2, 3) if rank == 1 else (3, 2)
    coalesced = [torch.ones(k) for k in sizes]
    expect(
        lambda: dist.group.WORLD.allgather_into_tensor_coalesced(
            [torch.empty(n * k) for k in sizes], coalesced
        ).wait()
    )
    # Different collectives of the same sizes: each rank names both alike.
    if rank == 0:
        expect(dist.all_gather_into_tensor, torch.empty(n * 2), torch.ones(2))
    else:
        expect(dist.all_to_all_single, torch.empty(n * 2), torch.ones(n * 2), [2] * n, [2] * n)
    # The group still works.
    out = torch.empty(n)
    dist.all_gather_into_tensor(out, torch.tensor([float(rank)]))
    _same(out, torch.arange(n, dtype=torch.float32), "after bad inputs")
    return messages


def repeated_shapes(rounds: int) -> int:
    """Calls of one shape again and again (plans from the group's cache), with fresh and reused
    tensors, an in-place AllGather between ordinary ones of the same shapes, strided tensors
    and uneven splits; every result checked. Returns the number of collectives."""
    rank, n = dist.get_rank(), dist.get_world_size()
    count = 0
    reused_in = torch.empty(n * 3)
    reused_out = torch.empty(n * 3)
    for i in range(rounds):
        # all_to_all_single, fresh tensors and reused ones.
        for fresh in (True, False):
            x = torch.arange(n * 3, dtype=torch.float32) + 1000 * rank + i
            inp = x if fresh else reused_in.copy_(x)
            out = torch.empty(n * 3) if fresh else reused_out
            dist.all_to_all_single(out, inp)
            want = torch.cat(
                [
                    torch.arange(3 * rank, 3 * rank + 3, dtype=torch.float32) + 1000 * r + i
                    for r in range(n)
                ]
            )
            _same(out, want, f"round {i} a2a fresh={fresh}")
            count += 1
        # Uneven splits of one shape: rank r sends r + j + 1 rows to rank j.
        send = [rank + j + 1 for j in range(n)]
        recv = [j + rank + 1 for j in range(n)]
        inp = torch.cat([torch.full((send[j], 2), float(100 * rank + j + i)) for j in range(n)])
        out = torch.empty(sum(recv), 2, dtype=torch.float32)
        dist.all_to_all_single(out, inp, recv, send)
        want = torch.cat([torch.full((recv[j], 2), float(100 * j + rank + i)) for j in range(n)])
        _same(out, want, f"round {i} uneven a2a")
        # AllGather into a tensor: ordinary, in place (input inside the output), ordinary.
        for in_place in (False, True, False):
            out = torch.full((n * 4,), -1.0)
            mine = torch.full((4,), float(rank + 10 * i))
            if in_place:
                out.view(n, 4)[rank].copy_(mine)
                mine = out.view(n, 4)[rank]
            dist.all_gather_into_tensor(out, mine)
            want = torch.cat([torch.full((4,), float(r + 10 * i)) for r in range(n)])
            _same(out, want, f"round {i} all_gather in_place={in_place}")
            count += 1
        # List forms, and a strided input (not cached: staged through a contiguous copy).
        outs = [torch.empty(2, 3, dtype=torch.bfloat16) for _ in range(n)]
        mine = (torch.arange(6, dtype=torch.bfloat16).view(3, 2) + rank + i).t()
        dist.all_gather(outs, mine)
        for r in range(n):
            _same(outs[r], (torch.arange(6, dtype=torch.bfloat16).view(3, 2) + r + i).t(), "ag")
        ins = [torch.full((j + 1,), rank * 10 + j + i, dtype=torch.int64) for j in range(n)]
        outs = [torch.empty(rank + 1, dtype=torch.int64) for _ in range(n)]
        dist.all_to_all(outs, ins)
        for j in range(n):
            _same(outs[j], torch.full((rank + 1,), j * 10 + rank + i, dtype=torch.int64), "a2a")
        count += 4
    return count


def _ring_state() -> dict[str, int]:
    """This process's mapped ring segments, and the files in /dev/shm it created (named
    after its pid: other test processes make and unlink theirs meanwhile)."""
    with open("/proc/self/maps") as f:
        maps = {line.split()[-2] for line in f if "freescale-ring-" in line}
    mine = f"freescale-ring-{os.getpid()}-"
    files = [name for name in os.listdir("/dev/shm") if name.startswith(mine)]
    return {"mapped": len(maps), "files": len(files)}


@contextlib.contextmanager
def _shm_full_for(suffix: str | None) -> Any:
    """While held, creating this rank's shared-memory segments whose names end with ``suffix``
    fails as on a full ``/dev/shm`` (``posix_fallocate``'s ENOSPC; the file is made, its memory
    is not); the other segments are made as usual. None: no segment fails."""
    from freescale_comm import shm

    if suffix is None:
        yield
        return
    original = shm.map_segment

    def map_segment(path: str, size: int, create: bool, reserve: bool = True) -> Any:
        if create and path.endswith(suffix):
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return original(path, size, create, reserve)

    shm.map_segment = map_segment
    try:
        yield
    finally:
        shm.map_segment = original


def _shm_full_for_ring_from(peer: int | None) -> Any:
    """``_shm_full_for`` this rank's rings from ``peer`` (host and staging)."""
    return _shm_full_for(None if peer is None else f"-{peer}to{dist.get_rank()}")


@contextlib.contextmanager
def _reads_refused(refused: bool) -> Iterator[None]:
    """The kernel refuses this rank's reads of its peers' memory (ptrace restrictions), as
    probed while a group is set up."""
    from freescale_comm import shm

    original = shm._can_read
    if refused:
        shm._can_read = lambda pid, address: False
    try:
        yield
    finally:
        shm._can_read = original


class _Recorded(logging.Handler):
    """Keeps the messages of the records it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def ring_cases(
    seed: int,
    cases: int,
    hosts: int,
    options: dict[str, Any],
    no_ring_from: dict[int, int] | None = None,
    no_outbox_on: int | None = None,
    reads_refused_on: int | None = None,
) -> dict[str, Any]:
    """Random cases over a freescale group whose ranks look as if on ``hosts`` hosts (the
    host identity set per rank before the group is made), with ``FreescaleOptions(**options)``,
    against Gloo; several collectives in flight at once; then the group destroyed. Returns what
    the ranks saw: the count, the paths, ring messages, and the rings' memory during and after.
    ``no_ring_from``: rank -> the peer whose ring that rank cannot make (``/dev/shm`` full);
    ``no_outbox_on``: the rank that cannot make its outbox; ``reads_refused_on``: the rank
    the kernel does not let read its peers' memory.
    """

    rank, n = dist.get_rank(), dist.get_world_size()
    before = _ring_state()
    warnings = _Recorded()
    logging.getLogger("freescale_comm.group").addHandler(warnings)
    try:
        with (
            _pretend_host(f"test-host-{rank * hosts // n}"),
            _shm_full_for_ring_from((no_ring_from or {}).get(rank)),
            _shm_full_for("-box" if no_outbox_on == rank else None),
            _reads_refused(reads_refused_on == rank),
        ):
            group = freescale_group(60, **options)
    finally:
        logging.getLogger("freescale_comm.group").removeHandler(warnings)
    during = _ring_state()
    deadline = time.monotonic() + 5
    while during["files"] > before["files"] and time.monotonic() < deadline:
        time.sleep(0.01)  # a peer may not have unlinked the ring it created yet
        during = _ring_state()
    count = run_random_cases(seed, cases, True, group, scale=40)
    # Collectives in flight together, waited in reverse: messages arrive before their receives.
    works, checks = [], []
    for k in range(4):
        x = torch.arange(n * 700, dtype=torch.float64) + 10_000 * rank + k
        out = torch.empty_like(x)
        works.append(dist.all_to_all_single(out, x, group=group, async_op=True))
        want = torch.cat(
            [
                torch.arange(700 * rank, 700 * rank + 700, dtype=torch.float64) + 10_000 * r + k
                for r in range(n)
            ]
        )
        checks.append((out, want))
    for work in reversed(works):
        work.wait()
    for k, (got, want) in enumerate(checks):
        _same(got, want, f"in flight #{k}")
    # Inputs overwritten as soon as the call returns: every peer has its bytes by then.
    for k in range(20):
        x = torch.full((n * 4096,), float(100 * rank + k), dtype=torch.float64)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        x.fill_(-1.0)
        want = torch.arange(n, dtype=torch.float64).repeat_interleave(4096) * 100 + k
        _same(out, want, f"overwritten input #{k}")
    paths = group.paths()
    # The algorithm a CPU AllGather is planned with (``allgather="auto"`` in these options).
    gathers = group._gather_options([torch.ones(1)]).allgather
    dist.destroy_process_group(group)
    gc.collect()
    return {
        "count": count,
        "paths": paths,
        "cpu_allgather": gathers,
        "warnings": warnings.messages,
        "during": {k: v - before[k] for k, v in during.items()},
        "after": {k: v - before[k] for k, v in _ring_state().items()},
    }


def own_pieces_on_helper_threads(
    seed: int, cases: int, threads: int, shm_max_bytes: int = -1
) -> dict[str, Any]:
    """Random cases, some large enough that a rank's own pieces (its local copies) reach 4 MiB,
    on a freescale group with ``host_copy_threads=threads`` (which also read a message from the
    sender's memory, above ``shm_max_bytes``), against Gloo and the reference; then large
    AllToAlls in flight together, waited in reverse, and inputs overwritten as soon as a call
    returns. Returns the count, what ``paths`` says of the copies, the messages read from the
    peers' memory (and of them those split between threads), and the jobs helpers ran."""
    rank, n = dist.get_rank(), dist.get_world_size()
    group = freescale_group(60, host_copy_threads=threads, shm_max_bytes=shm_max_bytes)
    count = run_random_cases(seed, cases, True, group, scale=60_000)
    rows = 1_100_000  # float64: 8.8 MB per peer: the own piece goes to helpers, reads split
    works, checks = [], []
    for k in range(3):
        x = torch.arange(n * rows, dtype=torch.float64) + 1e7 * rank + k
        out = torch.full_like(x, -1.0)
        works.append(dist.all_to_all_single(out, x, group=group, async_op=True))
        base = torch.arange(rows * rank, rows * rank + rows, dtype=torch.float64)
        checks.append((out, torch.cat([base + 1e7 * r + k for r in range(n)])))
    for work in reversed(works):
        work.wait()
    for k, (got, want) in enumerate(checks):
        _same(got, want, f"in flight #{k}")
    with _data_phase_order() as orders, _yields_beside_helpers() as yields:
        for k in range(3):
            x = torch.full((n * rows,), float(100 * rank + k), dtype=torch.float64)
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x, group=group)
            x.fill_(-1.0)
            want = torch.arange(n, dtype=torch.float64).repeat_interleave(rows) * 100 + k
            _same(out, want, f"overwritten input #{k}")
    paths = group.paths()
    dist.destroy_process_group(group)
    return {
        "count": count,
        "waits": paths[0]["waits"],
        "reads": sum(p["ring_reads"] for p in paths),
        "split_reads": sum(p["ring_split_reads"] for p in paths),
        "readable": all("read from the sender's memory" in p["path"] for p in paths),
        "why": paths[0]["why"],
        "helper_copy_jobs": paths[0]["helper_copy_jobs"],
        "data_phase_orders": orders,
        "yields_beside_helpers": yields,
    }


@contextlib.contextmanager
def _yields_beside_helpers() -> Iterator[list[int]]:
    """Counts (in its one element) the times a progressing thread yielded its core to poll while
    this process's helper or reader threads had work (they need the GIL, which a polling
    thread takes back first: it should sleep instead)."""
    from freescale_comm import engine, local_copies

    counted = [0]
    real_yield = os.sched_yield

    def counting_yield() -> None:
        counted[0] += local_copies.helpers_busy()
        real_yield()

    with mock.patch.object(engine.os, "sched_yield", counting_yield):
        yield counted


@contextlib.contextmanager
def _data_phase_order() -> Iterator[list[list[str]]]:
    """Records, per collective's start of its data phase, what the starting thread did in
    order: ``helpers`` (own pieces handed to helper threads), ``read`` (a peer's message read
    on this thread)."""
    from freescale_comm import collective, local_copies, shm

    orders: list[list[str]] = []
    current = threading.local()
    start_data, start_copies, read = (
        collective.Collective._start_data,
        local_copies.LocalCopies.start,
        shm.read_process,
    )

    def note(event: str) -> None:
        events = getattr(current, "events", None)
        if events is not None:
            events.append(event)

    def traced_start_data(self):
        current.events = []
        try:
            return start_data(self)
        finally:
            orders.append(current.events)
            current.events = None

    def traced_start(self, copies):
        if self.on_helpers(copies):
            note("helpers")
        return start_copies(self, copies)

    def traced_read(*args):
        note("read")
        return read(*args)

    with (
        mock.patch.object(collective.Collective, "_start_data", traced_start_data),
        mock.patch.object(local_copies.LocalCopies, "start", traced_start),
        mock.patch.object(shm, "read_process", traced_read),
    ):
        yield orders


def _huge_page_kb(address: int) -> int:
    """This process's ``AnonHugePages`` in the mapping that holds ``address`` (kB)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and ":" not in head:  # a mapping's first line: its address range
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def sends_on_huge_pages(enabled: bool) -> dict[str, Any]:
    """AllToAlls of 8 MiB per peer, read from the sender's memory (``shm_max_bytes`` 512 KiB),
    sending one input five times (the collapse tried from the second on, at most three times),
    on a group with ``host_huge_pages=enabled``: every result against the reference; then how
    many ranges this process (a new one) collapsed and the kernel's refusals by name, the huge
    pages behind the input, and the messages read."""
    from freescale_comm.huge_pages import huge_pages

    rank, n = dist.get_rank(), dist.get_world_size()
    group = freescale_group(60, shm_max_bytes=1 << 19, host_huge_pages=enabled)
    rows = 1 << 20  # float64: 8 MiB per peer
    x = torch.arange(n * rows, dtype=torch.float64) + 1e7 * rank
    for k in range(5):
        out = torch.full_like(x, -1.0)
        dist.all_to_all_single(out, x, group=group)
        base = torch.arange(rows * rank, rows * rank + rows, dtype=torch.float64)
        _same(out, torch.cat([base + 1e7 * r for r in range(n)]), f"call #{k}")
    paths = group.paths()
    dist.destroy_process_group(group)
    return {
        "collapsed": huge_pages.collapsed,
        "refusals": huge_pages.refusals,
        "unsupported": not huge_pages.supported(),
        "huge_kb": _huge_page_kb(x.data_ptr()),
        "reads": sum(p["ring_reads"] for p in paths),
    }


def early_data_after_a_bad_verdict(rounds: int) -> int:
    """Medium AllToAlls (128 KiB per peer: over the rings, sent with the headers) whose splits
    disagree on one rank, each followed by a good one of the same shape: the bad one fails on
    every rank and its early data never reaches the next one's outputs."""
    from freescale_comm import FreescaleValidationError

    rank, n = dist.get_rank(), dist.get_world_size()
    rows = 32 << 10  # float32: 128 KiB per peer
    for i in range(rounds):
        send = [rows] * n
        if rank == 1:
            send[0] += 1
        bad = torch.full((sum(send),), -1.0)
        try:
            dist.all_to_all_single(torch.empty(n * rows), bad, [rows] * n, send)
        except FreescaleValidationError:
            pass
        else:
            raise AssertionError("mismatched splits were accepted")
        x = torch.arange(n * rows, dtype=torch.float32) + 1e6 * rank + i
        out = torch.empty(n * rows)
        dist.all_to_all_single(out, x)
        want = torch.cat(
            [x[rank * rows : (rank + 1) * rows] - 1e6 * rank + 1e6 * r for r in range(n)]
        )
        _same(out, want, f"round {i} after a bad verdict")
    return rounds


def early_data_after_the_sequence_wraps() -> str:
    """A bad verdict whose early data the rings drop, then a good collective whose tags repeat
    the bad one's once the sequence number wraps (the counter is moved on, to half a round
    later and then to a whole one, rather than run through 2^20 collectives): the rings must
    not drop that one's early data too. Rank 0 calls late, so its peers' early data is in its
    rings first. Returns "ok"."""
    import itertools

    from freescale_comm import FreescaleValidationError
    from freescale_comm.transport import SEQ_BITS

    rank, n = dist.get_rank(), dist.get_world_size()
    # No outboxes: 128 KiB per peer then leaves early over the rings, headers behind it.
    group = freescale_group(15, shm_outbox_bytes=0)
    rows = 32 << 10
    send = [rows + (rank == 1 and peer == 0) for peer in range(n)]
    try:
        dist.all_to_all_single(
            torch.empty(n * rows), torch.ones(sum(send)), [rows] * n, send, group=group
        )
        raise AssertionError("mismatched splits were accepted")
    except FreescaleValidationError:
        pass
    x = torch.arange(n * rows, dtype=torch.float32) + 1e6 * rank
    want = torch.cat([x[rank * rows : (rank + 1) * rows] - 1e6 * rank + 1e6 * r for r in range(n)])
    for step in range(4):
        # Once each ring has passed the bad one's early data on (FIFO, two good ones), the
        # counter moves on: to half a round after the bad one (#1), then to where its tags
        # come round again.
        if step >= 2:
            group._ctx._seq = itertools.count(1 + (1 << (SEQ_BITS - 1 + step - 2)))
        if step == 3 and rank == 0:
            time.sleep(0.5)
        out = torch.empty(n * rows)
        dist.all_to_all_single(out, x, group=group)
        _same(out, want, f"good collective {step} (the last once the sequence number wrapped)")
    dist.destroy_process_group(group)
    return "ok"


def _rank_0_waits_in_between(first: Any, second: Any) -> None:
    """Calls two collectives (each a function of ``async_op``): rank 0 waits for the first
    before it calls the second, the other ranks call both at once, then wait for them."""
    if dist.get_rank() == 0:
        first(async_op=False)
        second(async_op=False)
        return
    works = [first(async_op=True), second(async_op=True)]
    for work in works:
        work.wait()


def later_data_never_overtakes_earlier(medium_kib: int, large_kib: int) -> str:
    """AllToAll a (large: its data leaves after the verdict) then b (medium: over the rings,
    early if nothing earlier may still send), in the same order on every rank; rank 0 waits
    for a before it calls b, the others call both at once. b's early data must not sit in
    rank 0's rings ahead of a's. Returns "ok"."""

    rank, n = dist.get_rank(), dist.get_world_size()
    group = freescale_group(20, host_path="shm", shm_outbox_bytes=0)
    large, medium = (large_kib << 10) // 4, (medium_kib << 10) // 4
    xa, xb = torch.full((n * large,), float(rank)), torch.full((n * medium,), rank + 0.5)
    oa, ob = torch.empty_like(xa), torch.empty_like(xb)
    if rank == 0:
        time.sleep(0.3)  # the others' a and b are both out first
    _rank_0_waits_in_between(
        functools.partial(dist.all_to_all_single, oa, xa, group=group),
        functools.partial(dist.all_to_all_single, ob, xb, group=group),
    )
    for out, rows, add in ((oa, large, 0.0), (ob, medium, 0.5)):
        want = torch.cat([torch.full((rows,), r + add) for r in range(n)])
        _same(out, want, f"AllToAll of {rows * 4} bytes per peer")
    dist.destroy_process_group(group)
    return "ok"


def read_counted_past_early_data(per_peer_kib: int, piece_kib: int, rounds: int) -> dict[str, Any]:
    """Rounds of an AllToAll of ``per_peer_kib`` per peer (read from the sender's memory:
    above ``shm_max_bytes``), then an AllGather of two ``piece_kib`` inputs (sent early, with
    its headers); rank 0 waits for the AllToAll before it calls the AllGather, the others call
    both at once. Rank 0's AllToAll completes only once its peers say they read its bytes,
    which must reach it past their AllGather data if that is in their rings first, waiting for
    the receive rank 0 has not posted yet (how the two interleave varies: rank 0 starts each
    round a little later, by a varying delay). Returns this rank's reads of its peers' memory,
    per peer.
    """

    rank, n = dist.get_rank(), dist.get_world_size()
    group = freescale_group(10, host_path="auto", shm_max_bytes=512 << 10, shm_outbox_bytes=0)
    rows, piece = (per_peer_kib << 10) // 4, (piece_kib << 10) // 4
    for k in range(rounds):
        x = torch.full((n * rows,), float(rank + k))
        out = torch.empty_like(x)
        pieces = [torch.full((piece,), rank + 0.5), torch.full((piece,), rank + 0.25)]
        gathered = [[torch.empty(piece) for _ in pieces] for _ in range(n)]
        if rank == 0:
            time.sleep(k % 10 * 1e-4)
        _rank_0_waits_in_between(
            functools.partial(dist.all_to_all_single, out, x, group=group),
            functools.partial(dist.all_gather_coalesced, gathered, pieces, group=group),
        )
        want = torch.arange(n, dtype=torch.float32).repeat_interleave(rows) + k
        _same(out, want, f"AllToAll #{k}")
        for p in range(n):
            for got, add in zip(gathered[p], (0.5, 0.25), strict=True):
                _same(got, torch.full((piece,), p + add), f"rank {p}'s piece #{k}")
    reads = {row["peer"]: row["ring_reads"] for row in group.paths()}
    dist.destroy_process_group(group)
    return reads


def ring_limit_by_pages(
    mode: str,
    torch_asks_by_rank: list[str],
    threads_by_rank: list[int] | None = None,
    probe_share: float = 0.0,
) -> tuple[str, int]:
    """A group under ``shm_max_bytes=-1`` whose ranks see the kernel's huge page ``mode`` and
    ``THP_MEM_ALLOC_ENABLE`` as given per rank (both read at set-up), with
    ``host_copy_threads`` per rank (1 by default: no helpers, whatever the cores), and
    ``probe_share`` in place of ``host_probe.READS_WIN_BELOW`` (0 by default: the probe, where
    it runs, chooses the rings), then an AllToAll of 1 MiB per peer, checked. Returns the path
    host bytes take to the next rank and how many messages this rank read from its peers'
    memory."""
    from freescale_comm import host_probe

    rank, n = dist.get_rank(), dist.get_world_size()
    threads = (threads_by_rank or [1] * n)[rank]
    with (
        mock.patch.dict(os.environ, {"THP_MEM_ALLOC_ENABLE": torch_asks_by_rank[rank]}),
        mock.patch("freescale_comm.info.transparent_huge_pages", return_value=mode),
        mock.patch.object(host_probe, "READS_WIN_BELOW", probe_share),
        mock.patch.dict(host_probe._verdicts, clear=True),
    ):
        group = freescale_group(10, host_path="auto", host_copy_threads=threads)
    rows = (1 << 20) // 4
    out = torch.empty(n * rows)
    dist.all_to_all_single(out, torch.full((n * rows,), float(rank)), group=group)
    _same(out, torch.arange(n, dtype=torch.float32).repeat_interleave(rows), "AllToAll")
    paths = group.paths()
    path = next(row["path"] for row in paths if row["peer"] == (rank + 1) % n)
    reads = sum(row["ring_reads"] for row in paths)
    dist.destroy_process_group(group)
    return path, reads


def host_probe_verdicts(probe_share: float | None) -> dict[str, Any]:
    """Two groups under ``shm_max_bytes=-1`` with 4 KiB pages and no read helpers, so that the
    ranks measure the rings against the reads at set-up (``host_probe``; ``probe_share`` in
    place of ``READS_WIN_BELOW`` where given), each then running an AllToAll of 1 MiB per peer
    (checked against the reference). Returns the first group's limit and reason, the rank's
    own reads of its peers' memory in each group, and how often the rank measured (once: the
    second group of the same processes reuses the verdict)."""
    from freescale_comm import host_probe

    rank, n = dist.get_rank(), dist.get_world_size()
    share = host_probe.READS_WIN_BELOW if probe_share is None else probe_share
    result: dict[str, Any] = {}
    measured = mock.Mock(wraps=host_probe.measure_host)
    with (
        mock.patch.dict(os.environ, {"THP_MEM_ALLOC_ENABLE": "0"}),
        mock.patch("freescale_comm.info.transparent_huge_pages", return_value="madvise"),
        mock.patch.object(host_probe, "READS_WIN_BELOW", share),
        mock.patch.object(host_probe, "measure_host", measured),
        mock.patch.dict(host_probe._verdicts, clear=True),
    ):
        for k in range(2):
            group = freescale_group(30, host_path="auto", host_copy_threads=1)
            if k == 0:
                result["limit"] = group._ctx.ring_max_bytes
                result["why"] = group._ctx.ring_max_why
            rows = (1 << 20) // 4
            x = torch.arange(n * rows, dtype=torch.float32) + 1e6 * rank
            got = torch.empty_like(x)
            dist.all_to_all_single(got, x, group=group)
            mine = torch.arange(rank * rows, rank * rows + rows, dtype=torch.float32)
            _same(got, torch.cat([mine + 1e6 * p for p in range(n)]), f"AllToAll in group {k}")
            result[f"reads_{k}"] = sum(row["ring_reads"] for row in group.paths())
            dist.destroy_process_group(group)
        result["measured"] = measured.call_count
    return result


def ring_gathers_only_even_pieces() -> list[str]:
    """``allgather="ring"``: list AllGathers of uneven pieces (the ring needs even ones) take
    the direct algorithm on every rank, whatever each rank's own piece, and are correct; then
    ranks whose ``allgather`` option differs fail to create a group together. Returns the
    errors (what follows "differ between ranks")."""
    from freescale_comm import FreescaleValidationError

    rank, n = dist.get_rank(), dist.get_world_size()

    def group_of(allgather: str) -> Any:
        return freescale_group(20, allgather=allgather, ring_threshold_bytes=4096)

    ring = group_of("ring")
    for sizes in (
        [100, 100] + [2000] * (n - 2),
        [0] + [2000] * (n - 1),
        [5 + 2 * p for p in range(n)],
    ):
        pieces = [torch.arange(sizes[p], dtype=torch.float32) + 1000 * p for p in range(n)]
        got = [torch.full((k,), -1.0) for k in sizes]
        dist.all_gather(got, pieces[rank], group=ring)
        for p in range(n):
            _same(got[p], pieces[p], f"uneven all_gather {sizes}, piece {p}")
    dist.destroy_process_group(ring)
    errors = []
    try:
        group_of("ring" if rank == 0 else "direct")
    except FreescaleValidationError as err:
        errors.append(str(err).split("differ between ranks: ", 1)[1])
    return errors


class _StorageLess(torch.Tensor):
    """A wrapper subclass without storage of its own (as DTensor, float8 wrappers): every op
    runs on the tensor it wraps."""

    @staticmethod
    def __new__(cls, wrapped: torch.Tensor) -> _StorageLess:
        return torch.Tensor._make_wrapper_subclass(
            cls, wrapped.shape, dtype=wrapped.dtype, device=wrapped.device
        )

    def __init__(self, wrapped: torch.Tensor) -> None:
        self.wrapped = wrapped

    @classmethod
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        from torch.utils._pytree import tree_map

        def unwrap(x: Any) -> Any:
            return x.wrapped if isinstance(x, _StorageLess) else x

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def _freed(tensor: torch.Tensor, free: bool) -> torch.Tensor:
    """``tensor``, its storage resized to nothing where ``free``."""
    if free:
        tensor.untyped_storage().resize_(0)
    return tensor


def new_user_mistakes() -> list[str]:
    """A meta tensor on one rank and a negative split: the same validation error on every rank
    at once (no rank left waiting for the timeout), and the group still works afterwards."""
    from freescale_comm import FreescaleValidationError

    rank, n = dist.get_rank(), dist.get_world_size()
    messages = []
    meta = torch.device("meta") if rank == 0 else torch.device("cpu")
    calls = [
        lambda: dist.all_to_all_single(torch.empty(n, device=meta), torch.ones(n, device=meta)),
        lambda: dist.all_gather_into_tensor(
            torch.empty(n, device=meta), torch.ones(1, device=meta)
        ),
        lambda: dist.all_gather([torch.empty(1) for _ in range(n)], torch.ones(1, device=meta)),
        lambda: dist.all_to_all_single(
            torch.empty(n), torch.ones(n), [1] * n, [n + 1, -1] + [0] * (n - 2)
        ),
        # Float split sizes (Gloo refuses them too), on rank 0 only, equal to the ints of a
        # shape the plan cache has seen (whose template took them, before).
        lambda: dist.all_to_all_single(
            torch.empty(n), torch.ones(n), [1] * n, [1.0 if rank == 0 else 1] * n
        ),
        # A lazily negated view as the output, whose bytes would have to be written negated,
        # on rank 0 only; the shape is one the plan cache has seen (the checks must not be
        # skipped there). As an input it is sent from a resolved copy.
        lambda: dist.all_to_all_single(
            torch._neg_view(torch.empty(n)) if rank == 0 else torch.empty(n), torch.ones(n)
        ),
        # all_gather_coalesced with one output list too few.
        lambda: dist.all_gather_coalesced([[torch.empty(1)]] * (n - 1), [torch.ones(1)]),
        # An expand()ed output on rank 0: its elements are one memory location (an internal
        # error that aborted the group, before).
        lambda: dist.all_to_all_single(
            torch.empty(1).expand(n) if rank == 0 else torch.empty(n), torch.ones(n)
        ),
        # A sparse output on rank 0 (its strides, asked for, raised on that rank alone).
        lambda: dist.all_to_all_single(
            torch.eye(n).to_sparse_csr() if rank == 0 else torch.empty(n, n), torch.ones(n, n)
        ),
        # Tensors whose elements are not in memory of their own, on rank 0, in the cached
        # shape: a storage-less wrapper subclass (as DTensor) as the output, an input whose
        # storage was resized to nothing. A cached plan wrote and read at their address 0 and
        # returned success with garbage, before.
        lambda: dist.all_to_all_single(
            _StorageLess(torch.empty(n)) if rank == 0 else torch.empty(n), torch.ones(n)
        ),
        lambda: dist.all_to_all_single(torch.empty(n), _freed(torch.ones(n), rank == 0)),
        # An async AllGather into a 0-d output on rank 0 (whose pieces, for Gloo's future
        # value, cannot be made).
        lambda: dist.all_gather_into_tensor(
            torch.empty(()) if rank == 0 else torch.empty(n), torch.ones(1), async_op=True
        ).wait(),
    ]
    for _ in range(2):  # the plan cache keeps a shape seen twice
        dist.all_to_all_single(torch.empty(n), torch.ones(n))
        dist.all_to_all_single(torch.empty(n), torch.ones(n), [1] * n, [1] * n)
    for call in calls:
        start = time.monotonic()
        try:
            call()
        except FreescaleValidationError as err:
            messages.append(f"{time.monotonic() - start:.3f} {err}")
            continue
        raise AssertionError("a bad call was accepted")
    out = torch.empty(n)
    dist.all_gather_into_tensor(out, torch.tensor([float(rank)]))
    _same(out, torch.arange(n, dtype=torch.float32), "after the mistakes")
    # Not a mistake: a strided output that requires grad is written as Gloo writes it, outside
    # autograd (its copy back from the staging buffer raised, and aborted the group, before).
    leaf = torch.zeros(2, n, requires_grad=True)
    dist.all_to_all_single(leaf.t(), torch.full((n, 2), float(rank)))
    _same(leaf.detach(), torch.arange(n, dtype=torch.float32).expand(2, n), "a leaf's view")
    return messages


def calls_gloo_refuses() -> list[tuple[float, str, str]]:
    """Calls that the group runs on Gloo and Gloo refuses (an op or dtype its collective does
    not take, a non-contiguous send), and sends and receives naming a rank outside the group
    (on which Gloo's crash the process). Returns (seconds, error type, message) per call; the
    group's own and delegated collectives must work afterwards."""
    rank, n = dist.get_rank(), dist.get_world_size()
    calls = [
        lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND),
        lambda: dist.all_reduce(torch.ones(2, dtype=torch.uint16)),
        lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.AVG),
        lambda: dist.broadcast(torch.ones(2, dtype=torch.uint16), src=0),
        lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BOR, async_op=True).wait(),
        lambda: dist.send(torch.ones(3, 2).t(), (rank + 1) % n),
        lambda: dist.send(torch.ones(2), n + 3),
        lambda: dist.recv(torch.empty(2), n),
        lambda: dist.isend(torch.ones(2), -1),
    ]
    errors = []
    for call in calls:
        start = time.monotonic()
        try:
            call()
        except Exception as err:  # what the user sees, whatever its type
            errors.append((time.monotonic() - start, type(err).__name__, str(err)))
            continue
        raise AssertionError("a call Gloo refuses was accepted")
    out = torch.empty(n)
    dist.all_to_all_single(out, torch.full((n,), float(rank)))
    _same(out, torch.arange(n, dtype=torch.float32), "the group's own AllToAll after them")
    total = torch.full((2,), float(rank))
    dist.all_reduce(total)
    _same(total, torch.full((2,), float(n * (n - 1) // 2)), "an AllReduce on Gloo after them")
    return errors


def all_gather_coalesced_like_gloo() -> int:
    """``dist.all_gather_coalesced`` (torch's layout: ``outputs[p][k]`` is rank p's input k)
    against Gloo's, twice per shape (the second from the plan cache, asynchronous: its
    future's value against Gloo's). Returns the calls."""
    rank, n = dist.get_rank(), dist.get_world_size()
    calls = 0
    for shapes in [[(2,), (3, 2)], [(2, 2), (1,), (2,)], [(5,)]]:
        for again in range(2):
            inputs = [
                make_tensor(shape, torch.float32, 100 * rank + 10 * k + again)
                for k, shape in enumerate(shapes)
            ]
            got = [[torch.full(shape, -1.0) for shape in shapes] for _ in range(n)]
            want = [[torch.full(shape, -1.0) for shape in shapes] for _ in range(n)]
            if again:  # async: torch hands back the future, whose value is the outputs
                got = dist.all_gather_coalesced(got, inputs, async_op=True).wait()
                want = dist.all_gather_coalesced(want, inputs, gloo_group(), True).wait()
                if n == 1:  # one list by input (Gloo's outputs[0])
                    assert all(isinstance(t, torch.Tensor) for t in got + want), (got, want)
                    got, want = [got], [want]
            else:
                dist.all_gather_coalesced(got, inputs)
                dist.all_gather_coalesced(want, inputs, group=gloo_group())
            assert [len(row) for row in got] == [len(row) for row in want], (got, want)
            for p in range(n):
                for k in range(len(shapes)):
                    _same(got[p][k], want[p][k], f"all_gather_coalesced {shapes} [{p}][{k}]")
            calls += 1
    return calls


def all_gather_mixing_dtypes() -> list[str]:
    """Coalesced AllGathers whose inputs each have a dtype of their own (NCCL accepts them):
    through ``_coalescing_manager`` and the group's ``allgather_coalesced``, three times each
    (the third from the plan cache's template), against the inputs every rank can make; then
    the calls that must fail on every rank. Returns the errors."""
    from freescale_comm import FreescaleValidationError

    rank, n = dist.get_rank(), dist.get_world_size()
    specs = [
        ((3,), torch.int64),
        ((2, 2), torch.float16),
        ((5,), torch.bool),
    ]

    def inputs_of(p: int, again: int) -> list[torch.Tensor]:
        return [
            make_tensor(shape, dtype, 100 * p + 10 * k + again)
            for k, (shape, dtype) in enumerate(specs)
        ]

    for again in range(3):  # the third from the plan cache's template
        mine = inputs_of(rank, again)
        want = [
            torch.cat([inputs_of(p, again)[k].flatten() for p in range(n)])
            for k in range(len(specs))
        ]
        outs = [torch.empty(n * t.numel(), dtype=t.dtype) for t in mine]
        with dist._coalescing_manager(async_ops=True) as manager:
            for out, tensor in zip(outs, mine, strict=True):
                dist.all_gather_into_tensor(out, tensor)
        manager.wait()
        for k, (out, expected) in enumerate(zip(outs, want, strict=True)):
            _same(out, expected, f"coalesced all_gather_into_tensor input {k}")
        lists = [[torch.empty_like(t) for t in mine] for _ in range(n)]
        # (``dist.all_gather_coalesced`` refuses mixed dtypes before the backend sees them.)
        dist.group.WORLD.allgather_coalesced(lists, mine).wait()
        for p in range(n):
            for k, tensor in enumerate(inputs_of(p, again)):
                _same(lists[p][k], tensor, f"all_gather_coalesced [{p}][{k}]")

    errors = []

    def expect(call: Any) -> None:
        try:
            call()
        except FreescaleValidationError as err:
            errors.append(str(err))
            return
        raise AssertionError("accepted bad input")

    # Rank 1's second input is int16 where the others' is float16: the same bytes, another dtype.
    mine = inputs_of(rank, 0)
    if rank == 1:
        mine[1] = mine[1].view(torch.int16)
    expect(
        lambda: dist.group.WORLD.allgather_into_tensor_coalesced(
            [torch.empty(n * t.numel(), dtype=t.dtype) for t in mine], mine
        ).wait()
    )
    # An output whose dtype is not its input's, on rank 0 only.
    mine = inputs_of(rank, 0)
    outs = [torch.empty(n * t.numel(), dtype=t.dtype) for t in mine]
    if rank == 0:
        outs[0] = outs[0].view(torch.float64)
    expect(lambda: dist.group.WORLD.allgather_into_tensor_coalesced(outs, mine).wait())
    # The group still works.
    out = torch.empty(n, dtype=torch.int64)
    dist.all_gather_into_tensor(out, torch.tensor([rank]))
    _same(out, torch.arange(n), "after the refused calls")
    return errors


def _error_after(call: Any) -> str:
    """``call()``'s error as "<seconds it took> <type>: <message>" ("no error" if none)."""
    start = time.monotonic()
    try:
        call()
    except Exception as err:
        return f"{time.monotonic() - start:.3f} {type(err).__name__}: {err}"
    return "no error"


def a_mistake_without_validation() -> str:
    """In a group that does not validate, rank 0 passes splits that do not add up: it raises
    at once, and its peers, which called correctly, raise at once too (the group is aborted)
    instead of waiting out the group's 60 s timeout for its messages. Returns the seconds and
    the error this rank saw."""

    rank, n = dist.get_rank(), dist.get_world_size()
    group = freescale_group(60, validate=False)
    splits = [n + 1] + [0] * (n - 1) if rank == 0 else [1] * n
    message = _error_after(
        lambda: dist.all_to_all_single(torch.empty(n), torch.ones(n), [1] * n, splits, group=group)
    )
    dist.destroy_process_group(group)
    return message


def a_rank_without_ucx(missing: int) -> str:
    """Rank ``missing`` cannot import ucxx (a node of another image) when a freescale group
    is made. Returns this rank's "<seconds> <error>" from ``new_group``."""
    import sys

    from freescale_comm.transport import Transport

    if Transport._instance is not None:
        raise AssertionError("this process has a UCX worker already: nothing would import")
    hidden = "ucxx._lib.libucxx"
    kept = sys.modules.get(hidden)
    if dist.get_rank() == missing:
        sys.modules[hidden] = None  # an import of it raises ImportError
    try:
        return _error_after(
            lambda: dist.new_group(backend="freescale", timeout=timedelta(seconds=30))
        )
    finally:
        if kept is not None:
            sys.modules[hidden] = kept


def a_call_with_its_own_timeout() -> str:
    """Rank 0 calls an AllToAll with a 2 s timeout in its options (ProcessGroup API, as Gloo
    honours it) in a group whose timeout is 30 s; the others never call it. Returns rank 0's
    "<seconds> <error>" (the others: "")."""
    group = freescale_group(30)
    message = ""
    if dist.get_rank() == 0:
        n = dist.get_world_size()
        opts = dist.AllToAllOptions()
        opts.timeout = timedelta(seconds=2)
        message = _error_after(
            lambda: group.alltoall_base(torch.empty(n), torch.ones(n), [], [], opts).wait()
        )
    dist.barrier()
    dist.destroy_process_group(group)
    return message


def a_size_mismatch_without_validation(count: int) -> dict[str, Any]:
    """In a group on one host that does not validate, rank 1 expects ``count`` more elements
    from rank 0 than rank 0 sends it; every other piece agrees. Returns this rank's error (or
    "no error") and whether its output holds what its peers sent it."""
    rank, n = dist.get_rank(), dist.get_world_size()
    group = freescale_group(30, validate=False, host_path="shm")
    receives = [count] * n
    if rank == 1:
        receives[0] += count
    sent = torch.full((count * n,), float(rank))
    out = torch.full((sum(receives),), -1.0)
    message = _error_after(
        lambda: dist.all_to_all_single(out, sent, receives, [count] * n, group=group)
    )
    expected = torch.cat([torch.full((k,), float(p)) for p, k in enumerate(receives)])
    dist.destroy_process_group(group)
    return {"error": message, "output_right": bool(torch.equal(out, expected))}


def ring_gather_then_all_to_all(validate: bool) -> str:
    """Rank 0 issues a ring AllGather and an AllToAll asynchronously while the last rank is
    late: the AllToAll's data to rank 1 must not go ahead of rank 0's forward of the last
    rank's piece in their ring (a ring delivers in order, and rank 1 posts the AllToAll's
    receive only after the AllGather). Returns "ok" or the error this rank saw."""
    rank, n = dist.get_rank(), dist.get_world_size()
    group = freescale_group(8, validate=validate, host_path="shm", allgather="ring")
    piece = 1024
    gathered, out = torch.empty(n * piece), torch.empty(n * 16)
    try:
        if rank == n - 1:
            time.sleep(0.5)  # rank 0's forward of this rank's piece to rank 1 comes late
        gather = dist.all_gather_into_tensor(
            gathered, torch.full((piece,), float(rank)), group=group, async_op=rank == 0
        )
        scatter = dist.all_to_all_single(
            out, torch.full((n * 16,), float(rank)), group=group, async_op=rank == 0
        )
        if rank == 0:
            gather.wait()
            scatter.wait()
        _same(gathered, torch.arange(n).repeat_interleave(piece).float(), "the AllGather")
        _same(out, torch.arange(n).repeat_interleave(16).float(), "the AllToAll")
        result = "ok"
    except Exception as err:
        result = f"{type(err).__name__}: {err}"
    dist.destroy_process_group(group)
    return result


def destroy_while_a_callback_starts_a_collective() -> dict[str, Any]:
    """Rank 0 destroys a group while its collective is still in flight (the others join it
    1 s later), and a callback chained to that collective with ``collect_all`` starts another
    one as the destroy fails the first: the destroy must not wait for that collective, which
    no thread would ever progress. Returns how long rank 0's destroy took and what the
    callback's collective raised (the others: nothing)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    group = freescale_group(30)
    seen: dict[str, Any] = {}
    if rank != 0:
        time.sleep(1.0)
    work = dist.all_to_all_single(torch.empty(n), torch.ones(n), group=group, async_op=True)

    def start_another(_: Any) -> None:
        try:
            dist.all_to_all_single(torch.empty(n), torch.ones(n), group=group)
            seen["callback"] = "no error"
        except Exception as err:
            seen["callback"] = f"{type(err).__name__}: {err}"

    if rank == 0:  # the others' first collective may well succeed: rank 0's header is out
        torch.futures.collect_all([work.get_future()]).add_done_callback(start_another)
        time.sleep(0.2)
        start = time.monotonic()
        dist.destroy_process_group(group)
        seen["destroy_s"] = time.monotonic() - start
    else:
        dist.destroy_process_group(group)
    dist.barrier()
    return seen


def wait_for_a_finished_work_in_a_chained_callback(rounds: int) -> list[str]:
    """A callback chained with ``collect_all`` waits for works that are done, as
    ``[w.wait() for w in works]`` does; it runs on the engine thread where the last of them
    finishes there (rank 1 joins late). A wait for a finished work waits for nothing: it
    must not be refused there. Returns, per round, what the callback and the next call saw."""
    rank, n = dist.get_rank(), dist.get_world_size()
    group = freescale_group(30)
    seen = []
    for _ in range(rounds):
        done = dist.all_to_all_single(torch.empty(n), torch.ones(n), group=group, async_op=True)
        done.wait()
        if rank == 1:
            time.sleep(0.2)
        last = dist.all_to_all_single(torch.empty(n), torch.ones(n), group=group, async_op=True)

        def wait_all(_: Any, works: tuple[Any, ...] = (done, last)) -> str:
            try:
                for work in works:
                    work.wait()
                return "ok"
            except Exception as err:
                return f"{type(err).__name__}: {err}"

        waited = torch.futures.collect_all([done.get_future(), last.get_future()]).then(wait_all)
        try:
            dist.all_to_all_single(torch.empty(n), torch.ones(n), group=group)
            after = "ok"
        except Exception as err:
            after = f"{type(err).__name__}: {err}"
        seen.append(f"{waited.wait()} / {after}")
    dist.destroy_process_group(group)
    return seen


def destroy_while_a_callback_runs() -> dict[str, Any]:
    """A ``then`` callback sleeps 2 s when the group is destroyed: the destroy waits for it,
    as Gloo's does, and leaves no callback thread. Each rank attaches it to a collective its
    peer joins 0.3 s later (so it runs on the callback thread, not at once in ``then``).
    Returns the destroy's seconds and whether the callback finished and its thread is left."""

    def callback_threads() -> set[int]:
        return {t.ident for t in threading.enumerate() if t.name == "freescale-comm-callbacks"}

    rank, n = dist.get_rank(), dist.get_world_size()
    others = callback_threads()  # other groups' (the shared world group's, say)
    group = freescale_group(30)
    finished = threading.Event()

    def slow(_: Any) -> None:
        time.sleep(2.0)
        finished.set()

    works = []
    for turn in range(n):  # rank ``turn`` calls first and attaches; the others join late
        if rank != turn:
            time.sleep(0.3)
        works.append(
            dist.all_to_all_single(torch.empty(n), torch.ones(n), group=group, async_op=True)
        )
        if rank == turn:
            works[-1].get_future().then(slow)
        works[-1].wait()
    start = time.monotonic()
    dist.destroy_process_group(group)
    return {
        "destroy_s": time.monotonic() - start,
        "callback_finished": finished.is_set(),
        "callback_thread_left": bool(callback_threads() - others),
    }


def future_values_like_gloo() -> list[str]:
    """The values of asynchronous collectives' futures and their works' ``result()`` on CPU
    against Gloo's for the same calls: their structure (lists, tensors, shapes) and contents.
    Returns what differed."""
    rank, n = dist.get_rank(), dist.get_world_size()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    calls = {
        "all_gather_into_tensor": lambda g: gather(
            torch.empty(2 * n), torch.full((2,), float(rank)), group=g, async_op=True
        ),
        "all_to_all_single": lambda g: dist.all_to_all_single(
            torch.empty(n), torch.full((n,), float(rank)), group=g, async_op=True
        ),
        "all_gather": lambda g: dist.all_gather(
            [torch.empty(2) for _ in range(n)], torch.full((2,), float(rank)), g, True
        ),
        "all_to_all": lambda g: dist.all_to_all(
            [torch.empty(1) for _ in range(n)], [torch.full((1,), float(rank))] * n, g, True
        ),
    }

    def shape_of(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.tolist())
        return [shape_of(v) for v in value]

    differ = []
    for what, call in calls.items():
        for again in range(3):  # the third from the plan cache
            try:  # Gloo first: torch 2.11's has no list AllToAll, which it refuses on every rank
                gloo_work = call(gloo_group())
            except RuntimeError as err:
                if "does not support alltoall" not in str(err):
                    raise
                break
            works = call(dist.group.WORLD), gloo_work
            mine, gloos = (shape_of(work.get_future().wait()) for work in works)
            if mine != gloos:
                differ.append(f"{what} (call {again}): {mine} where Gloo has {gloos}")
            for work in works:
                work.wait()  # Gloo's result() asks for it
            mine, gloos = (shape_of(work.result()) for work in works)
            if mine != gloos:
                differ.append(f"{what} result() (call {again}): {mine} where Gloo has {gloos}")
    return differ


def lazy_views_and_autograd_versions() -> dict[str, Any]:
    """Inputs that are lazily negated views (their bytes are not their values) give Gloo's
    results (torch's front end refuses conjugated complex inputs before any backend); every
    output's autograd version grows at the call, as Gloo's does, so a backward through a
    tensor saved before the collective overwrote it raises. Returns what differed from Gloo
    (empty when nothing did) and each op's version bump."""
    rank, n = dist.get_rank(), dist.get_world_size()
    ours, gloo = freescale_group(30), dist.new_group(backend="gloo")
    base = (torch.arange(2.0 * n) + 1j * (rank + 1)).to(torch.complex64) * (rank + 1)
    inputs = {"negative": base.conj().imag}  # is_neg(): its bytes are the imaginary parts
    differ = []
    for name, x in inputs.items():
        for op in ("all_gather", "all_gather_into_tensor", "all_to_all_single"):
            got = {}
            for label, group in (("freescale", ours), ("gloo", gloo)):
                if op == "all_gather":
                    outs = [torch.empty_like(x.resolve_conj().resolve_neg()) for _ in range(n)]
                    dist.all_gather(outs, x, group=group)
                    got[label] = torch.cat(outs)
                elif op == "all_gather_into_tensor":
                    out = torch.empty(n * x.numel(), dtype=x.dtype)
                    dist.all_gather_into_tensor(out, x, group=group)
                    got[label] = out
                else:
                    out = torch.empty_like(x.resolve_conj().resolve_neg())
                    dist.all_to_all_single(out, x, group=group)
                    got[label] = out
            if not torch.equal(got["freescale"], got["gloo"]):
                differ.append(f"{op} of a {name} view")
    bumps = {}
    for op in ("all_gather", "all_gather_into_tensor", "all_to_all_single"):
        buf = torch.arange(float(n)) + rank
        before = buf._version
        if op == "all_gather":
            dist.all_gather(list(buf.chunk(n)), torch.ones(1), group=ours)
        elif op == "all_gather_into_tensor":
            dist.all_gather_into_tensor(buf, torch.ones(1), group=ours)
        else:
            dist.all_to_all_single(buf, torch.ones(n), group=ours)
        bumps[op] = buf._version > before
    weight = torch.ones(n, requires_grad=True)
    buf = torch.arange(float(n)) + rank
    loss = (weight * buf).sum()  # autograd saves buf
    dist.all_gather_into_tensor(buf, torch.full((1,), 9.0), group=ours)
    try:
        loss.backward()
        backward = "no error"
    except RuntimeError as err:
        backward = "modified by an inplace operation" if "inplace" in str(err) else str(err)
    dist.destroy_process_group(ours)
    dist.destroy_process_group(gloo)
    return {"differ": differ, "bumps": bumps, "backward": backward}


def timeout_set_after_creation() -> dict[str, Any]:
    """torch's ``_set_pg_timeout`` reaches the group's own collectives: raised from 3 s to
    30 s, an AllToAll that rank 1 joins 5 s late succeeds; lowered to 2 s, one it joins 6 s
    late fails after about 2 s. Also ``split_group`` raises at once. Returns what each saw."""
    from freescale_comm import FreescaleError

    rank, n = dist.get_rank(), dist.get_world_size()
    group = freescale_group(3)
    seen: dict[str, Any] = {}
    try:
        group.split_group([0, 1])
        seen["split"] = "no error"
    except FreescaleError as err:
        seen["split"] = str(err)
    for name, timeout_s, late_s in (("raised", 30, 5.0), ("lowered", 2, 6.0)):
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)
        dist.barrier()  # the next collective takes it up at once
        if rank == 1:
            time.sleep(late_s)
        start = time.monotonic()
        try:
            dist.all_to_all_single(torch.empty(n), torch.ones(n), group=group)
            seen[name] = "ok"
        except Exception as err:
            seen[name] = f"{type(err).__name__} after {time.monotonic() - start:.1f} s"
    dist.barrier()
    return seen


def an_interrupt_while_a_collective_starts() -> str:
    """A ``KeyboardInterrupt`` reaches rank 0 while its collective starts, after it took the
    collective's outbox number and before it wrote its headers there: it raises that, and its
    peers raise at once (the group is aborted) rather than wait out the group's 60 s timeout
    for headers that never come. Returns the seconds and the error this rank saw."""
    from freescale_comm import outbox

    rank, n = dist.get_rank(), dist.get_world_size()
    group = freescale_group(60, host_path="shm")
    original = outbox.Outboxes.write

    def interrupted(self: Any, seq: int, messages: Any) -> None:
        raise KeyboardInterrupt

    if rank == 0:
        outbox.Outboxes.write = interrupted
    start = time.monotonic()
    try:
        message = _error_after(
            lambda: dist.all_to_all_single(torch.empty(n), torch.ones(n), group=group)
        )
    except KeyboardInterrupt:
        message = f"{time.monotonic() - start:.3f} KeyboardInterrupt: during the call"
    finally:
        outbox.Outboxes.write = original
    dist.destroy_process_group(group)
    return message


def an_internal_error_on_one_rank() -> str:
    """Rank 0 fails while its collective moves data (``_start_data`` raises, as a bug or the
    OS refusing memory would): it raises that error, and its peers, which wait for its data,
    raise at once (the group is aborted) rather than after the group's 60 s timeout. Returns
    the seconds and the error this rank saw."""
    from freescale_comm import collective
    from freescale_comm.local_copies import INLINE_READ_BYTES

    rank, n = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="freescale", timeout=timedelta(seconds=60))
    original = collective.Collective._start_data

    def broken(self: Any) -> None:
        raise RuntimeError("injected: no memory for the data phase")

    if rank == 0:
        collective.Collective._start_data = broken
    # Moved in the data phase (not folded, not sent early), and more than an asynchronous call
    # reads in its call.
    per_peer = INLINE_READ_BYTES // 4 + 1024
    try:
        # Asynchronous, with reads above ``INLINE_READ_BYTES``: a call whose pieces are all read
        # at named addresses runs in its call (``Collective._express``) otherwise, which has no
        # ``_start_data``.
        message = _error_after(
            lambda: dist.all_to_all_single(
                torch.empty(n * per_peer), torch.ones(n * per_peer), group=group, async_op=True
            ).wait()
        )
    finally:
        collective.Collective._start_data = original
    dist.destroy_process_group(group)
    return message


def die_during_collective(
    victim: int, delay_s: float, per_peer: int = 256, group: Any = None
) -> float:
    """Every rank runs AllToAlls back to back; the victim exits after ``delay_s``, most likely
    in the middle of one (its peers may be reading its memory); the survivors' collective must
    raise (they re-raise it). ``per_peer``: float32 elements for each peer (the rings, or read
    from the sender's memory above ``shm_max_bytes``); ``group``: the world's by default."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    if rank == victim:
        threading.Timer(delay_s, os._exit, (7,)).start()
    start = time.monotonic()
    x = torch.ones(n * per_peer)
    try:
        for _ in range(1_000_000):
            dist.all_to_all_single(torch.empty_like(x), x, group=group)
    except Exception as err:
        raise RuntimeError(
            f"survivor {rank} raised after {time.monotonic() - start:.1f} s: {err}"
        ) from err
    return time.monotonic() - start


def die_during_collective_on_pretend_hosts(victim: int, delay_s: float, per_peer: int) -> float:
    """``die_during_collective`` on a freescale subgroup whose ranks each look as if on a host
    of their own (``FREESCALE_HOST_ID``, set before the process's first group makes its UCX
    context): every pair's bytes take UCX within one machine."""
    from freescale_comm.options import HOST_ENV

    os.environ[HOST_ENV] = f"pretend-host-{dist.get_rank()}"
    group = dist.new_group(backend="freescale", timeout=timedelta(seconds=20))
    return die_during_collective(victim, delay_s, per_peer, group)


def die_while_a_group_is_set_up(victim: int, step: str) -> None:
    """The victim exits in the middle of a new group's set-up (``step``: joining its directory,
    making its rings, its outbox, or measuring the rings against the reads: 4 KiB pages and no
    read helpers, so that the probe runs); the others' ``new_group`` must raise within the
    group timeout (5 s), having left nothing of theirs in /dev/shm (they re-raise with what
    they left and the error's text)."""
    from freescale_comm import FreescaleOptions, directory, host_probe, outbox, shm

    rank = dist.get_rank()
    if rank == victim:
        owner, name = {
            "directory": (directory, "Directory"),
            "rings": (shm, "open_links"),
            "outbox": (outbox, "open_outboxes"),
            "probe": (host_probe, "measure_host"),
        }[step]
        setattr(owner, name, lambda *args, **kwargs: os._exit(7))
    options = FreescaleOptions(host_copy_threads=1) if step == "probe" else None
    start = time.monotonic()
    try:
        with (
            mock.patch.dict(os.environ, {"THP_MEM_ALLOC_ENABLE": "0"}),
            mock.patch("freescale_comm.info.transparent_huge_pages", return_value="madvise"),
            mock.patch.dict(host_probe._verdicts, clear=True),
        ):
            dist.new_group(backend="freescale", timeout=timedelta(seconds=5), pg_options=options)
    except Exception as err:
        mine = f"freescale-ring-{os.getpid()}-"
        left = [name for name in os.listdir("/dev/shm") if name.startswith(mine)]
        raise RuntimeError(
            f"survivor {rank} raised after {time.monotonic() - start:.1f} s, leaving {left}: "
            f"{type(err).__name__}: {err}"
        ) from err
    raise AssertionError("the group was set up without the victim")


def late_peer_wait_cost(idle_wait: str) -> dict[str, Any]:
    """What a wait of 1 s for a late peer costs rank 0 in CPU under ``idle_wait``: it polls,
    yielding its core, for the group's window (``engine.idle_poll_s``), then sleeps."""
    from freescale_comm.cpu import usable_cores

    rank, n = dist.get_rank(), dist.get_world_size()
    group = freescale_group(30, idle_wait=idle_wait)
    x = torch.arange(n * 4, dtype=torch.float32) + 100 * rank
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    dist.barrier()
    if rank != 0:
        time.sleep(1.0)
    start_cpu, start = time.thread_time(), time.monotonic()
    dist.all_to_all_single(out, x, group=group)
    waited_s, cpu_s = time.monotonic() - start, time.thread_time() - start_cpu
    _same(out, torch.cat([torch.arange(4 * rank, 4 * rank + 4) + 100.0 * r for r in range(n)]), "")
    result = {
        "poll_s": group._ctx.idle_poll_s,
        "oversubscribed": n > usable_cores(),  # the ranks share this host
        "waited_s": waited_s,
        "cpu_s": cpu_s,
    }
    dist.destroy_process_group(group)
    return result


def threads_after_destroy() -> dict[str, Any]:
    """A freescale subgroup inside a Gloo world: its threads exist only while it does."""

    def count() -> list[str]:
        names = []
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        return sorted(names)

    if torch.cuda.is_available():
        # The group's engine thread makes the CUDA context current, and the driver starts
        # threads of its own (cuda-EvtHandlr, ...) that live as long as the process: start them
        # first, so that only threads of the group are compared (seen on the H200 machine).
        torch.zeros(1, device="cuda")
    before_python = {t.name for t in threading.enumerate()}
    before = count()
    group = dist.new_group(backend="freescale", timeout=timedelta(seconds=30))
    out = torch.empty(dist.get_world_size())
    dist.all_gather_into_tensor(out, torch.tensor([1.0]), group=group)
    # A callback attached before its collective is done starts the group's callback thread.
    work = dist.all_gather_into_tensor(out, torch.tensor([2.0]), group=group, async_op=True)
    work.get_future().then(lambda f: f.value()[0].sum()).wait()
    during = count()
    during_python = {t.name for t in threading.enumerate()} - before_python
    dist.destroy_process_group(group)
    del group
    # Gloo's run-loop thread lives as long as its device object, which a reference cycle can
    # keep until the next garbage collection, and threads end asynchronously on a loaded
    # machine: collect and allow a few seconds before calling one left behind.
    deadline = time.monotonic() + 5
    while count() != before and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    return {
        "before": before,
        "during": during,
        "after": count(),
        "engine_during": sorted(during_python),
        "left": sorted({t.name for t in threading.enumerate()} - before_python),
    }


def context_freed_by_destroy() -> bool:
    """Whether destroying a freescale subgroup frees its context with its last reference,
    without waiting for a garbage collection (its context referred back to itself)."""
    group = dist.new_group(backend="freescale", timeout=timedelta(seconds=30))
    out = torch.empty(dist.get_world_size())
    dist.all_gather_into_tensor(out, torch.tensor([1.0]), group=group)
    context = weakref.ref(group._ctx)
    gc.disable()
    try:
        dist.destroy_process_group(group)
        del group
        return context() is None
    finally:
        gc.enable()


def cached_calls_free_their_tensors() -> list[bool]:
    """Whether the tensors of collectives served by the plan cache (the second call of each
    shape), small and read from this process's memory (1 MiB per peer), are freed with their
    last reference in the caller. Returns one answer per size."""
    n = dist.get_world_size()
    answers = []
    for per_peer in (64, 1 << 20):
        refs = []
        for _ in range(2):
            inp, out = torch.ones(n * per_peer // 4), torch.empty(n * per_peer // 4)
            dist.all_to_all_single(out, inp)
            refs += [weakref.ref(inp), weakref.ref(out)]
            del inp, out
        gc.collect()
        answers.append(all(ref() is None for ref in refs))
    return answers


def one_element_strided_tensors() -> int:
    """AllGathers and an AllToAll whose one-element inputs and outputs have a stride other
    than 1 (torch calls them contiguous: ``t[:, 0]`` of a 1 x 2 tensor); returns the checks."""
    rank, n = dist.get_rank(), dist.get_world_size()
    mine = torch.tensor([[float(rank), -1.0]])[:, 0]
    out = torch.empty(n)
    dist.all_gather_into_tensor(out, mine)
    assert out.tolist() == [float(r) for r in range(n)], out
    grid = torch.zeros(1, 2 * n, dtype=torch.int64)
    dist.all_gather([grid[:, 2 * r] for r in range(n)], mine.to(torch.int64))
    assert grid[0, ::2].tolist() == list(range(n)) and not grid[0, 1::2].any(), grid
    sends = [torch.tensor([[10.0 * rank + p, -1.0]])[:, 0] for p in range(n)]
    received = torch.zeros(1, 2 * n)
    dist.all_to_all([received[:, 2 * p] for p in range(n)], sends)
    assert received[0, ::2].tolist() == [10.0 * p + rank for p in range(n)], received
    return 3


def a_failed_start_beside_a_chained_callback() -> dict[str, Any]:
    """Rank 0: an async AllGather X whose ``collect_all`` chain starts a collective of the group
    from the thread that completes X (C++ runs chained callbacks there: the engine); meanwhile
    another thread's collective fails to start after 1 s (a CUDA driver error, simulated), and
    its rank aborts the group. Rank 1 calls X after 0.3 s. Returns what each party saw."""
    from freescale_comm import collective

    group = freescale_group(20)
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        time.sleep(0.3)
        dist.all_gather_into_tensor(torch.empty(n), torch.ones(1), group=group)
        return {}
    chained: list[str] = []

    def callback(_: Any) -> None:
        try:
            dist.all_gather_into_tensor(
                torch.empty(n), torch.ones(1), group=group, async_op=True
            ).wait()
        except Exception as err:
            chained.append(type(err).__name__)

    work = dist.all_gather_into_tensor(torch.empty(n), torch.ones(1), group=group, async_op=True)
    chain = torch.futures.collect_all([work.get_future()]).then(callback)
    start = collective.Collective.start
    failed: list[str] = []

    def failing_start(self: Any, express: bool = False, caller_waits: bool = True) -> None:
        if threading.current_thread().name == "failing":
            time.sleep(1.0)
            raise RuntimeError("CUDA driver call failed (simulated)")
        start(self, express, caller_waits)

    def failing() -> None:
        try:
            dist.all_gather_into_tensor(torch.empty(n), torch.ones(1), group=group)
        except Exception as err:
            failed.append(str(err))

    with mock.patch.object(collective.Collective, "start", failing_start):
        thread = threading.Thread(target=failing, name="failing", daemon=True)
        thread.start()
        thread.join(15)
    with contextlib.suppress(Exception):
        chain.wait()
    return {"failing_thread_done": not thread.is_alive(), "failed": failed, "chained": chained}


def a_collect_all_callback_that_waits() -> tuple[str, float, str]:
    """Every rank chains, with ``collect_all``, a callback that calls a synchronous AllGather to
    an async AllGather's future on a group with a 20 s timeout: rank 0 once that future is done
    (C++ runs the callback at once, in rank 0's thread, where its collective starts), the others
    before rank 0 has called it (C++ runs it on their engine thread). Returns the error that
    reached the chain (or the async AllGather), the seconds it took after rank 0's call, and
    the error of a later AllGather of the group."""
    group = freescale_group(20)
    rank, n = dist.get_rank(), dist.get_world_size()

    def waits(_: Any) -> None:
        dist.all_gather_into_tensor(torch.empty(n), torch.ones(1), group=group)

    message = ""
    if rank != 0:
        work = dist.all_gather_into_tensor(
            torch.empty(n), torch.ones(1), group=group, async_op=True
        )
        chain = torch.futures.collect_all([work.get_future()]).then(waits)
    dist.barrier(group=gloo_group())
    began = time.monotonic()
    try:
        if rank == 0:
            work = dist.all_gather_into_tensor(
                torch.empty(n), torch.ones(1), group=group, async_op=True
            )
            work.wait()
            chain = torch.futures.collect_all([work.get_future()]).then(waits)
        chain.wait()
    except Exception as err:
        message = str(err)
    elapsed = time.monotonic() - began
    later = ""
    try:
        dist.all_gather_into_tensor(torch.empty(n), torch.ones(1), group=group)
    except Exception as err:
        later = str(err)
    dist.barrier(group=gloo_group())
    return message, elapsed, later


def a_collect_all_callback_that_waits_for_its_own_collective() -> tuple[bool, bool]:
    """Every rank chains, with ``collect_all``, a callback that waits for the very AllGather
    whose future it follows (rank 0 calls it after the others have chained, so C++ runs their
    callbacks on the engine thread). Returns whether the chain and a later AllGather succeeded.
    """
    group = freescale_group(20)
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        dist.barrier(group=gloo_group())
    work = dist.all_gather_into_tensor(torch.empty(n), torch.ones(1), group=group, async_op=True)
    chain = torch.futures.collect_all([work.get_future()]).then(
        lambda _: (work.wait(), work.synchronize(), work.is_completed(), work.is_success())
    )
    if rank != 0:
        dist.barrier(group=gloo_group())
    chained = chain.wait() == (True, None, True, True)
    out = torch.empty(n)
    dist.all_gather_into_tensor(out, torch.full((1,), float(rank)), group=group)
    return chained, torch.equal(out, torch.arange(n).float())


def a_peer_that_never_calls() -> str:
    """Rank 0 calls an AllGather on a group with a 2 s timeout that no other rank calls;
    returns its error (empty on the other ranks)."""
    group = freescale_group(2)
    message = ""
    if dist.get_rank() == 0:
        try:
            dist.all_gather_into_tensor(
                torch.empty(dist.get_world_size()), torch.ones(1), group=group
            )
        except Exception as err:
            message = str(err)
    dist.barrier(group=gloo_group())
    return message


def mismatched_shared_options(field: str, value: Any) -> tuple[str, float]:
    """Creates a freescale group where rank 1 alone sets ``field`` to ``value`` (an options
    field, or ``wire_version``: as if it ran another version); returns the error its creation
    raised here and how long it took, after checking the world group still works."""
    from freescale_comm import FreescaleOptions, directory

    other = dist.get_rank() == 1
    wire = field == "wire_version"
    options = FreescaleOptions(**({field: value} if other and not wire else {}))
    version = value if other and wire else directory.WIRE_VERSION
    with mock.patch.object(directory, "WIRE_VERSION", version):
        return _refused_group(options, "a group whose ranks' options differ was created")


def _refused_group(options: Any, created: str) -> tuple[str, float]:
    """The validation error a freescale group's creation with ``options`` raises here and how
    long it took (``created``: the assertion if it does not), after checking the world group
    still works."""
    from freescale_comm import FreescaleValidationError

    started = time.monotonic()
    try:
        dist.new_group(backend="freescale", timeout=timedelta(seconds=60), pg_options=options)
    except FreescaleValidationError as err:
        message, took = str(err), time.monotonic() - started
    else:
        raise AssertionError(created)
    out = torch.empty(dist.get_world_size())
    dist.all_gather_into_tensor(out, torch.tensor([1.0]))
    return message, took


def options_refused_on_one_rank(how: str) -> tuple[str, float]:
    """Creates a freescale group where rank 1 alone has options the backend refuses (``env``:
    a ``FREESCALE_*`` value out of range; ``type``: ``pg_options`` of another type); returns
    the error its creation raised here and how long it took, after checking the world group
    still works."""
    other = dist.get_rank() == 1
    options: Any = {"shm_pool_bytes": 1} if other and how == "type" else None
    variable = "FREESCALE_SHM_POOL_BYTES"
    with mock.patch.dict(os.environ, {variable: "65536"} if other and how == "env" else {}):
        return _refused_group(options, "a group with refused options on one rank was created")


def per_device_backend_strings() -> dict[str, Any]:
    """CPU AllGathers and AllToAlls over freescale groups made with per-device backend strings:
    for each, the results checked and how many the group ran itself; for a string naming a
    backend the group does not have, the error of its first collective."""
    from freescale_comm import FreescaleError

    rank, n = dist.get_rank(), dist.get_world_size()
    report: dict[str, Any] = {}
    for spec in ("cpu:gloo,cuda:freescale", "cpu:freescale,cuda:nccl", "cpu:freescale,cuda:ucc"):
        group = dist.new_group(backend=spec, timeout=timedelta(seconds=30))
        launched: list[Any] = []

        def counted(op: Any, caller_waits: bool, launch=group._ctx.launch, seen=launched) -> None:
            seen.append(op)
            launch(op, caller_waits)

        group._ctx.launch = counted
        try:
            out = torch.empty(n)
            dist.all_gather_into_tensor(out, torch.tensor([float(rank)]), group=group)
            assert out.tolist() == [float(r) for r in range(n)], out
            received = torch.empty(n)
            dist.all_to_all_single(received, torch.full((n,), float(rank)), group=group)
            assert received.tolist() == [float(r) for r in range(n)], received
            report[spec] = len(launched)
        except FreescaleError as err:
            report[spec] = str(err)
        dist.destroy_process_group(group)
    return report


def _bytes_near_eager(rng: random.Random, eager: int) -> int:
    """A per-peer size: none, tiny, either side of the eager limit, or well past it."""
    return rng.choice([0, 64, eager // 2, eager - 64, eager, eager + 64, 4 * eager])


def _produce_late(values: torch.Tensor, dev: torch.device, sleep_cycles: int) -> torch.Tensor:
    """``values`` on the GPU, written by the caller's stream after a GPU sleep."""
    target = torch.empty(values.shape, dtype=values.dtype, device=dev)
    torch.cuda._sleep(sleep_cycles)
    target.copy_(values.pin_memory(), non_blocking=True)
    return target


def run_cuda_cases(
    seed: int,
    cases: int,
    cuda_path: str,
    hosts: int | list[int] = 1,
    validate: bool = True,
    no_ring_from: dict[int, int] | None = None,
    allgather: str = "auto",
) -> dict[str, Any]:
    """Random AllGather / AllToAll cases on CUDA tensors over a group forced to ``cuda_path``
    (``hosts``: how many pretend hosts the ranks are spread over, or each rank's host;
    ``no_ring_from``: rank -> the peer whose ring that rank cannot make, ``/dev/shm`` being
    full; ``allgather``: the option); returns the count and, per peer, the start of its CUDA
    path and the pushes into its mailbox.

    Per-peer sizes straddle the eager limit (data folded into the header, through page-locked
    host memory) and go well past it (UCX's device path, or the staged pipeline), often in one
    uneven AllToAll; inputs are written on the caller's stream behind a GPU sleep, so a
    collective that read them before that stream's work would see stale bytes.
    """
    from freescale_comm import FreescaleOptions

    rank, n = dist.get_rank(), dist.get_world_size()
    host = hosts[rank] if isinstance(hosts, list) else rank * hosts // n
    with _shm_full_for_ring_from((no_ring_from or {}).get(rank)):
        dev, group = cuda_group(
            host=f"test-host-{host}", cuda_path=cuda_path, validate=validate, allgather=allgather
        )
    eager = FreescaleOptions().eager_bytes
    width = 16
    for case in range(cases):
        rng = random.Random(seed * 7919 + case)
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64, torch.uint8])
        row_bytes = width * dtype.itemsize

        def rows_of(rng: random.Random = rng, row_bytes: int = row_bytes) -> int:
            return _bytes_near_eager(rng, eager) // row_bytes

        seed_of = functools.partial(_tensor_seed, seed, case)

        def produce(values: torch.Tensor, rng: random.Random = rng) -> torch.Tensor:
            return _produce_late(values, dev, int(rng.random() * 2_000_000))

        kind = rng.choice(["ag_tensor", "ag_list", "a2a_even", "a2a_uneven", "a2a_list"])
        what = f"{cuda_path} case {case} {kind} {dtype}"
        if kind.startswith("ag"):
            rows = rows_of()
            inputs = [make_tensor((rows, width), dtype, seed_of(r)) for r in range(n)]
            mine = produce(inputs[rank])
            if kind == "ag_tensor":
                out = torch.empty((n * rows, width), dtype=dtype, device=dev)
                dist.all_gather_into_tensor(out, mine, group=group)
                _same(out.cpu(), torch.cat(inputs), what)
            else:
                outs = [torch.empty((rows, width), dtype=dtype, device=dev) for _ in range(n)]
                dist.all_gather(outs, mine, group=group)
                for r in range(n):
                    _same(outs[r].cpu(), inputs[r], f"{what} slot {r}")
            continue
        if kind == "a2a_even":
            per = rows_of()
            splits = [[per] * n for _ in range(n)]
        else:
            splits = [[rows_of() for _ in range(n)] for _ in range(n)]
        inputs = [
            [make_tensor((splits[r][j], width), dtype, seed_of(r, j)) for j in range(n)]
            for r in range(n)
        ]
        want = torch.cat([inputs[j][rank] for j in range(n)])
        if kind == "a2a_list":
            outs = [
                torch.empty((splits[j][rank], width), dtype=dtype, device=dev) for j in range(n)
            ]
            dist.all_to_all(outs, [produce(t) for t in inputs[rank]], group=group)
            _same(torch.cat([o.cpu() for o in outs]), want, what)
        else:
            out = torch.empty((len(want), width), dtype=dtype, device=dev)
            dist.all_to_all_single(
                out,
                produce(torch.cat(inputs[rank])),
                [splits[j][rank] for j in range(n)],
                splits[rank],
                group=group,
            )
            _same(out.cpu(), want, what)
    rows = group.paths()
    paths = {row["peer"]: (row["cuda"].split(":")[0], row["ipc_pushes"]) for row in rows}
    dist.destroy_process_group(group)
    return {"cases": cases, "paths": paths, "why": {row["peer"]: row["cuda"] for row in rows}}


def staged_ring_all_gathers(host_path: str, calls: int) -> int:
    """Ring AllGathers of the staged pipeline over 2 pretend hosts of 2 ranks each: every piece
    is several chunks, and each rank's ring neighbour is on its host for one direction (whose
    chunks used to take the host ring, which delivers in order, and stall behind a chunk the
    pipeline's receive window had not posted yet). Returns how many results were checked."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunk = 64 << 10
    dev, group = cuda_group(
        host=f"test-host-{rank * 2 // n}",
        cuda_path="staged",
        allgather="ring",
        chunk_bytes=chunk,
        host_path=host_path,
    )
    for call in range(calls):
        rows = (3 + call % 3) * chunk // 4  # 3 to 5 chunks of float32 per piece
        inputs = [make_tensor((rows,), torch.float32, 1000 * call + r) for r in range(n)]
        out = torch.empty(n * rows, device=dev)
        dist.all_gather_into_tensor(out, inputs[rank].to(dev), group=group)
        _same(out.cpu(), torch.cat(inputs), f"ring AllGather {call} over {host_path}")
    dist.destroy_process_group(group)
    return calls


def ring_cuda_checks(seed: int, cuda_path: str = "staged") -> dict[str, Any]:
    """The paths between ranks of one host (``cuda_path``: the staging rings, or CUDA IPC):
    large uneven AllToAlls that wrap the rings many times in three dtypes, AllGathers, list
    forms, against locally computed results; a mismatch raising on every rank; ``wait`` and the
    stream order; the profiler's kernel count; the rings' memory during and after the group.
    Returns what the rank saw."""
    from torch.profiler import ProfilerActivity, profile

    from freescale_comm import FreescaleValidationError

    rank, n = dist.get_rank(), dist.get_world_size()
    before = _ring_state()
    dev, group = cuda_group(cuda_path=cuda_path, allgather="auto")
    report: dict[str, Any] = {"paths": group.paths()}
    width = 4
    checked = 0
    for k, dtype in enumerate((torch.float32, torch.bfloat16, torch.int64)):
        unit = (3 << 20) // (width * dtype.itemsize)  # 3 MiB: chunks split across slots
        splits = [[((i + 2 * j + k) % 4) * unit + 7 * i + j for j in range(n)] for i in range(n)]
        inputs = [
            [make_tensor((splits[r][j], width), dtype, seed * 100 + 10 * r + j) for j in range(n)]
            for r in range(n)
        ]
        out = torch.full(
            (sum(splits[j][rank] for j in range(n)), width), 0, dtype=dtype, device=dev
        )
        dist.all_to_all_single(
            out,
            torch.cat(inputs[rank]).to(dev),
            [splits[j][rank] for j in range(n)],
            splits[rank],
            group=group,
        )
        _same(out.cpu(), torch.cat([inputs[j][rank] for j in range(n)]), f"a2a uneven {dtype}")
        rows = unit + 3 * k
        pieces = [make_tensor((rows, width), dtype, seed * 7 + r) for r in range(n)]
        gathered = torch.empty((n * rows, width), dtype=dtype, device=dev)
        dist.all_gather_into_tensor(gathered, pieces[rank].to(dev), group=group)
        _same(gathered.cpu(), torch.cat(pieces), f"all_gather_into_tensor {dtype}")
        outs = [torch.empty((rows, width), dtype=dtype, device=dev) for _ in range(n)]
        dist.all_gather(outs, pieces[rank].to(dev), group=group)
        _same(torch.cat([o.cpu() for o in outs]), torch.cat(pieces), f"all_gather {dtype}")
        outs = [torch.empty((splits[j][rank], width), dtype=dtype, device=dev) for j in range(n)]
        dist.all_to_all(outs, [t.to(dev) for t in inputs[rank]], group=group)
        for j in range(n):
            _same(outs[j].cpu(), inputs[j][rank], f"all_to_all {dtype} from {j}")
        checked += 4
    report["checked"] = checked
    # A mismatch raises on every rank; the group goes on.
    try:
        dist.all_to_all_single(
            torch.empty(n * (2 + rank), device=dev), torch.empty(n * 2, device=dev), group=group
        )
        report["mismatch"] = "nothing raised"
    except FreescaleValidationError as err:
        report["mismatch"] = type(err).__name__
    # Stream order: ~50 ms of GPU sleep queued before the input is written.
    numel = 4 << 20
    x = torch.zeros(numel, device=dev)
    y = torch.full((numel,), -1.0, device=dev)
    source = torch.arange(numel, dtype=torch.float32, device=dev) + rank * numel
    want = torch.cat(
        [(torch.arange(numel, dtype=torch.float32) + r * numel).view(n, -1)[rank] for r in range(n)]
    )
    start_event, end_event = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    start_event.record()
    torch.cuda._sleep(100_000_000)
    end_event.record()
    torch.cuda.synchronize()
    sleep_s = start_event.elapsed_time(end_event) / 1e3
    # Once untimed: a first IPC call on allocations new to the peers waits for them to map
    # those (which may wait for their queued GPU work; freescale_comm's README).
    dist.all_to_all_single(y, x, group=group)
    calls = {}
    for async_op in (False, True):
        y.fill_(-1.0)
        torch.cuda.synchronize()
        dist.barrier(group=gloo_group())
        torch.cuda._sleep(100_000_000)
        x.copy_(source)
        t0 = time.perf_counter()
        work = dist.all_to_all_single(y, x, group=group, async_op=async_op)
        if async_op:
            work.wait()
        returned = time.perf_counter() - t0
        got = y.clone()  # the consumer, on the caller's stream
        x.zero_()  # the input reused right after wait
        torch.cuda.synchronize()
        calls[str(async_op)] = {
            "call_s": returned,
            "done_s": time.perf_counter() - t0,
            "correct": bool(torch.equal(got.cpu(), want)),
        }
    report["stream"] = {"sleep_s": sleep_s, "calls": calls}
    # No kernel on the path (memcpys only).
    src = torch.randn(8 << 20, device=dev)
    dst = torch.empty_like(src)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            dist.all_to_all_single(dst, src, group=group)
            dist.all_gather_into_tensor(dst, src[: src.numel() // n], group=group)
            dist.all_to_all_single(dst, src, group=group, async_op=True).wait()
        torch.cuda.synchronize()
    kernels = [
        e.name
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not e.name.startswith(("Memcpy", "Memset"))
    ]
    report["kernels"] = sorted(set(kernels))
    report["during"] = {k: v - before[k] for k, v in _ring_state().items()}
    dist.destroy_process_group(group)
    gc.collect()
    report["after"] = {k: v - before[k] for k, v in _ring_state().items()}
    return report


def ipc_special_cases(seed: int) -> dict[str, Any]:
    """The IPC path off its main road: memory CUDA IPC cannot export (expandable segments:
    copied through the group's scratch allocation), a group that does not validate, strided
    outputs, several collectives in flight at once, CPU and CUDA calls of one shape (each with
    its cached plan). Returns what the rank saw."""
    from freescale_comm import ipc

    rank, n = dist.get_rank(), dist.get_world_size()
    report: dict[str, Any] = {}
    for validate in (True, False):
        dev, group = cuda_group(cuda_path="ipc", validate=validate)
        rows = 1000 + 17 * seed
        pieces = [make_tensor((rows, 3), torch.float32, seed * 11 + r) for r in range(n)]
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        try:
            torch.cuda.empty_cache()
            mine = pieces[rank].to(dev)
            report[f"exportable_{validate}"] = ipc._export(mine.data_ptr()) is not None
            gathered = torch.empty((n * rows, 3), device=dev)
            dist.all_gather_into_tensor(gathered, mine, group=group)
            _same(gathered.cpu(), torch.cat(pieces), f"expandable all_gather validate={validate}")
        finally:
            torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        del mine, gathered
        torch.cuda.empty_cache()
        for device in ("cpu", dev, "cpu", dev, dev):  # plans cached from a shape's 2nd call
            gathered = torch.empty((n * rows, 3), device=device)
            dist.all_gather_into_tensor(gathered, pieces[rank].to(device), group=group)
            _same(gathered.cpu(), torch.cat(pieces), f"{device} all_gather validate={validate}")
        # Strided output: received contiguous, copied into place after the pulls.
        wide = torch.zeros((n * rows, 6), device=dev)
        dist.all_gather_into_tensor(wide[:, ::2], pieces[rank].to(dev), group=group)
        _same(wide[:, ::2].cpu(), torch.cat(pieces), f"strided all_gather validate={validate}")
        # Eight AllToAlls in flight, then their waits in order.
        inputs = [torch.full((n * 4096,), float(rank * 100 + k), device=dev) for k in range(8)]
        outputs = [torch.empty(n * 4096, device=dev) for _ in range(8)]
        works = [
            dist.all_to_all_single(o, i, group=group, async_op=True)
            for o, i in zip(outputs, inputs, strict=True)
        ]
        for work in works:
            work.wait()
        for k, out in enumerate(outputs):
            want = torch.cat([torch.full((4096,), float(r * 100 + k)) for r in range(n)])
            _same(out.cpu(), want, f"in flight #{k} validate={validate}")
        report[f"paths_{validate}"] = [row["cuda"] for row in group.paths()]
        dist.destroy_process_group(group)
    return report


def _ipc_group_in_step(timeout_s: float) -> tuple[Any, torch.Tensor]:
    """A new IPC group whose first collective is done on every rank's GPU, and the input of
    the collectives that follow (1,024 floats per peer)."""
    n = dist.get_world_size()
    dev, group = cuda_group(timeout_s=timeout_s, cuda_path="ipc")
    x = torch.ones(n * 1024, device=dev)
    dist.all_to_all_single(torch.empty_like(x), x, group=group)
    torch.cuda.synchronize()
    dist.barrier(group=gloo_group())
    return group, x


def gpu_stalled_past_the_timeout() -> dict[str, Any]:
    """Rank 1's GPU is busy for about 7 s before a synchronous IPC collective of a group whose
    timeout is 3 s: rank 0's call returns once queued, its GPU waits for rank 1's flags, and
    nothing drives the collective any more. It must still fail at its deadline (the group
    aborted, the waits released) rather than hold rank 0's streams until rank 1's GPU is
    back. Returns when rank 0's call returned, when its GPU drained, and what a later call
    raised."""
    rank = dist.get_rank()
    group, x = _ipc_group_in_step(timeout_s=3)
    if rank == 1:
        torch.cuda._sleep(14_000_000_000)
    start = time.monotonic()
    dist.all_to_all_single(torch.empty_like(x), x, group=group)
    returned = time.monotonic() - start
    torch.cuda.synchronize()
    drained = time.monotonic() - start
    try:
        dist.all_to_all_single(torch.empty_like(x), x, group=group)
        after = "no error"
    except Exception as err:
        after = type(err).__name__
    dist.destroy_process_group(group)
    return {"returned_s": returned, "drained_s": drained, "after": after}


def die_during_ipc_collective(victim: int) -> dict[str, float]:
    """The victim dies right after its collective is queued behind a second of GPU work: its
    header is out, so the survivors queue theirs and wait on the GPU for its flags, which never
    come. The survivors must raise, and their streams drain (abort releases the waits)."""

    rank = dist.get_rank()
    group, x = _ipc_group_in_step(timeout_s=20)
    if rank == victim:
        torch.cuda._sleep(2_000_000_000)  # about a second before its inputs are ready
        dist.all_to_all_single(torch.empty_like(x), x, group=group)  # returns once queued
        os._exit(7)
    start = time.monotonic()
    try:
        for _ in range(1_000_000):
            dist.all_to_all_single(torch.empty_like(x), x, group=group)
    except Exception as err:
        raised = time.monotonic() - start
        drained = threading.Event()
        cuda_error: list[str] = []

        def drain() -> None:
            # The released copies read the dead peer's memory, which CUDA leaves undefined
            # once its exporter is gone: a CUDA error there is reported, a hang fails the test.
            try:
                torch.cuda.synchronize()
            except RuntimeError as failure:
                cuda_error.append(str(failure)[:200])
            finally:
                drained.set()

        threading.Thread(target=drain, daemon=True).start()
        if not drained.wait(15):
            raise RuntimeError(f"survivor {rank}: its GPU streams never drained") from err
        raise RuntimeError(
            f"survivor {rank} raised after {raised:.1f} s, GPU drained after "
            f"{time.monotonic() - start:.1f} s (CUDA error: {cuda_error or 'none'}): {err}"
        ) from err
    return {"raised": -1.0}


def outputs_written_when_a_barrier_returns(rounds: int) -> int:
    """Asynchronous AllToAll and AllGather of a few MiB, then ``dist.barrier()`` and the
    outputs read without a wait: written by then, as Gloo's barrier waits for the work before
    it. Returns the rounds checked."""
    rank, n = dist.get_rank(), dist.get_world_size()
    per_peer = 1 << 20  # floats: 4 MiB to each peer
    for k in range(rounds):
        sent = torch.full((n * per_peer,), float(rank + 10 * k))
        received = torch.zeros(n * per_peer)
        gathered = torch.zeros(n * per_peer)
        works = [
            dist.all_to_all_single(received, sent, async_op=True),
            dist.all_gather_into_tensor(gathered, sent[:per_peer], async_op=True),
        ]
        dist.barrier()
        want = torch.arange(n, dtype=torch.float32).repeat_interleave(per_peer) + 10 * k
        if not (torch.equal(received, want) and torch.equal(gathered, want)):
            raise AssertionError(f"rank {rank}, round {k}: an output not written at the barrier")
        for work in works:
            work.wait()
    return rounds


def collectives_in_flight_finish_at_a_destroy(rounds: int) -> int:
    """Asynchronous AllToAll and AllGather of a few MiB on a new group, then the group
    destroyed before any wait: as with Gloo, they finish first (their waits return True, their
    outputs written). Returns the rounds checked."""
    rank, n = dist.get_rank(), dist.get_world_size()
    per_peer = 1 << 20  # floats: 4 MiB to each peer
    want = torch.arange(n, dtype=torch.float32).repeat_interleave(per_peer)
    for k in range(rounds):
        group = freescale_group(30)
        sent = torch.full((n * per_peer,), float(rank))
        received, gathered = torch.zeros(n * per_peer), torch.zeros(n * per_peer)
        works = [
            dist.all_to_all_single(received, sent, group=group, async_op=True),
            dist.all_gather_into_tensor(gathered, sent[:per_peer], group=group, async_op=True),
        ]
        dist.destroy_process_group(group)
        if not all(work.wait() for work in works):
            raise AssertionError(f"rank {rank}, round {k}: a wait returned False")
        if not (torch.equal(received, want) and torch.equal(gathered, want)):
            raise AssertionError(f"rank {rank}, round {k}: an output not written")
    return rounds


def barrier_in_a_callback() -> float:
    """A future's callback calls ``dist.barrier`` while a later AllGather is in flight: on rank
    0 the callback runs at once (its future was done), before that AllGather starts; on the
    others it runs on the callback thread, behind it. The barrier must pair across ranks, not
    wait there for the AllGather (which rank 0 starts only after its barrier). Returns the
    seconds it all took."""
    group = freescale_group(20)
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.ones(n * 1024)
    began = time.monotonic()
    if rank == 0:
        time.sleep(0.5)  # the others start the AllGather before the first collective is done
    first = dist.all_to_all_single(torch.empty_like(x), x, group=group, async_op=True)
    if rank == 0:
        first.wait()
    chained = first.get_future().then(lambda _: dist.barrier(group=group))
    later = dist.all_gather_into_tensor(torch.empty(n * x.numel()), x, group=group, async_op=True)
    chained.wait()
    later.wait()
    dist.destroy_process_group(group)
    return time.monotonic() - began


def an_interrupt_while_a_collective_waits() -> dict[str, Any]:
    """A ``KeyboardInterrupt`` reaches rank 0 while its synchronous AllToAll waits for rank 1,
    which calls 2 s late: rank 0 raises it at once; the collective goes on in the background
    and writes rank 0's output once rank 1's data arrives (the README's failure behaviour), and
    the group serves the next call. Returns what rank 0 saw (rank 1: its output)."""
    import signal

    rank, n = dist.get_rank(), dist.get_world_size()
    group = freescale_group(30, host_path="shm")
    output = torch.zeros(n)
    report: dict[str, Any] = {}
    if rank == 0:
        threading.Timer(
            0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)
        ).start()
        start = time.monotonic()
        try:
            dist.all_to_all_single(output, torch.full((n,), 1.0 + rank), group=group)
            report["raised"] = None
        except KeyboardInterrupt:
            report["raised"] = "KeyboardInterrupt"
        report["raised_after_s"] = time.monotonic() - start
        report["output_at_interrupt"] = output.tolist()
        deadline = time.monotonic() + 10
        while output[1].item() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        report["output_later"] = output.tolist()
    else:
        time.sleep(2)
        dist.all_to_all_single(output, torch.full((n,), 1.0 + rank), group=group)
        report["output_later"] = output.tolist()
    after = torch.zeros(n)
    dist.all_to_all_single(after, torch.full((n,), 10.0 + rank), group=group)
    report["next_call"] = after.tolist()
    dist.destroy_process_group(group)
    return report


def express_calls(rounds: int) -> dict[str, Any]:
    """Small collectives, which run to their end in their call (the express path), each result
    compared with Gloo's: AllToAll even and uneven in three dtypes, uneven with splits that
    change every call (no plan cached), AllGather into a tensor and into a list; then one call
    that rank 0 enters 50 ms late
    (its peers' poll window runs out: the general path finishes it), one where rank 0 waits
    asynchronously, and one whose splits rank 1 changes (a table never judged: every rank
    raises the same validation error), each followed by a good call. Returns this rank's
    express count after the first part and at the end, and the errors."""
    from freescale_comm import FreescaleValidationError

    rank, n = dist.get_rank(), dist.get_world_size()
    # Polling for 2 ms however many cores: the peers of a call come within it nearly always.
    ours, gloo = freescale_group(30, idle_wait="yield"), gloo_group()

    def call(kind: str, dtype: torch.dtype, salt: int, group: Any, **kw: Any) -> torch.Tensor:
        values = make_tensor((n * 6,), dtype, _tensor_seed(salt, 0, rank))
        if kind == "even":
            out = torch.empty_like(values)
            work = dist.all_to_all_single(out, values, group=group, **kw)
        elif kind == "uneven":  # rank r sends j + r + 1 elements to rank j
            send = [j + rank + 1 for j in range(n)]
            recv = [rank + j + 1 for j in range(n)]
            out = torch.empty(sum(recv), dtype=dtype)
            work = dist.all_to_all_single(out, values[: sum(send)], recv, send, group=group, **kw)
        elif kind == "varying":  # rank r sends (j + r + salt) % 5 elements to rank j
            send = [(j + rank + salt) % 5 for j in range(n)]
            recv = [(rank + j + salt) % 5 for j in range(n)]
            out = torch.empty(sum(recv), dtype=dtype)
            work = dist.all_to_all_single(out, values[: sum(send)], recv, send, group=group, **kw)
        elif kind == "gather":
            out = torch.empty(n * 6, dtype=dtype)
            work = dist.all_gather_into_tensor(out, values[:6], group=group, **kw)
        else:  # gather_list
            outs = [torch.empty(6, dtype=dtype) for _ in range(n)]
            work = dist.all_gather(outs, values[:6], group=group, **kw)
        if work is not None:
            work.wait()
        return torch.cat(outs) if kind == "gather_list" else out

    kinds = [("even", torch.float32), ("even", torch.int64), ("uneven", torch.bfloat16)]
    kinds += [("varying", torch.float32), ("gather", torch.float32), ("gather_list", torch.int64)]

    def checked(kind: str, dtype: torch.dtype, salt: int, **kw: Any) -> None:
        got, want = call(kind, dtype, salt, ours, **kw), call(kind, dtype, salt, gloo)
        _same(got, want, f"{kind} {dtype} #{salt}")

    for salt in range(rounds):
        for kind, dtype in kinds:
            checked(kind, dtype, salt)
    first = ours._ctx.express_runs
    if rank == 0:
        time.sleep(0.05)
    checked("even", torch.float32, rounds)
    if rank == 0:
        checked("even", torch.float32, rounds + 1, async_op=True)
    else:
        checked("even", torch.float32, rounds + 1)
    errors = []
    try:
        if rank == 1:
            call("uneven", torch.float32, rounds + 2, ours)
        else:
            call("even", torch.float32, rounds + 2, ours)
    except FreescaleValidationError as err:
        errors.append(str(err).split(": ", 1)[1])
    checked("even", torch.float32, rounds + 3)
    checked("even", torch.float32, rounds + 4)
    return {"first": first, "last": ours._ctx.express_runs, "errors": errors}


@contextlib.contextmanager
def threads_advancing() -> Iterator[list[str]]:
    """The names of the threads that advance a collective meanwhile (``Collective.advance``),
    one per advance."""
    from freescale_comm import collective

    names: list[str] = []
    original = collective.Collective.advance

    def advance(op: Any) -> bool:
        names.append(threading.current_thread().name)
        return original(op)

    with mock.patch.object(collective.Collective, "advance", advance):
        yield names


def asynchronous_calls(rounds: int) -> dict[str, Any]:
    """Asynchronous AllToAlls, each result compared with Gloo's: small ones (uneven every other
    round) that rank 0 calls 0.2 s after its peers, so that their headers are in and its call
    runs to its end there; then larger ones, whose reads of the peers' memory exceed
    ``INLINE_READ_BYTES``, that rank 1 calls 0.2 s late, so that the others' calls wait for it.
    Returns this rank's express count before and after each part, and per larger call whether
    the calling thread advanced it (its ``wait`` drove it)."""
    from freescale_comm.local_copies import INLINE_READ_BYTES

    rank, n = dist.get_rank(), dist.get_world_size()
    ours, gloo = freescale_group(30, shm_max_bytes=1 << 19), gloo_group()
    ctx = ours._ctx
    large = INLINE_READ_BYTES // 4 // (n - 1) + 1024  # float32 elements per peer

    def alltoall(per_peer: int, salt: int, uneven: bool, group: Any, **kw: Any) -> Any:
        send = [per_peer + (j if uneven else 0) for j in range(n)]
        recv = [per_peer + (rank if uneven else 0)] * n
        values = make_tensor((sum(send),), torch.float32, _tensor_seed(salt, 2, rank))
        out = torch.empty(sum(recv))
        work = dist.all_to_all_single(out, values, recv, send, group=group, **kw)
        return out if work is None else (work, out)

    def part(per_peer: int, late: int) -> tuple[tuple[int, int], list[bool]]:
        express, driven_here = ctx.express_runs, []
        caller = threading.current_thread().name
        for salt in range(rounds):
            uneven = salt % 2 == 1
            if rank == late:
                time.sleep(0.2)
            with threads_advancing() as names:
                work, got = alltoall(per_peer, salt, uneven, ours, async_op=True)
                work.wait()
            driven_here.append(caller in names)
            _same(got, alltoall(per_peer, salt, uneven, gloo), f"{per_peer} per peer #{salt}")
        return (express, ctx.express_runs), driven_here

    small = part(3, late=0)
    larger = part(large, late=1)
    dist.destroy_process_group(ours)
    return {"small": small, "larger": larger}


def completed_once_the_future_is(calls: int) -> list[bool]:
    """What ``is_completed`` answers between a collective's future completing and its event
    being set (a thread woken by the future asks then), for ``calls`` async AllToAlls.
    ``_done`` is what ``is_completed`` answers after its hand-over, which must not run under the
    collective's lock that completes the future."""
    from freescale_comm import collective as collective_module
    from freescale_comm.work import FreescaleWork

    seen: list[bool] = []
    complete = collective_module.Collective._set_outcome

    def set_outcome(op: Any, ok: bool, value: Any) -> None:
        complete(op, ok, value)
        seen.append(FreescaleWork(op)._done())

    x = torch.arange(dist.get_world_size() * 4, dtype=torch.float32)
    with mock.patch.object(collective_module.Collective, "_set_outcome", set_outcome):
        for _ in range(calls):
            dist.all_to_all_single(torch.empty_like(x), x, async_op=True).get_future().wait()
    return seen


def reads_at_named_addresses(threads: int) -> dict[str, Any]:
    """Collectives whose pieces above 512 KiB are read from their sender's memory at the
    address its header names (``named_reads``), each result compared with Gloo's, on a group
    with ``host_copy_threads=threads``: AllToAll even (1 MiB per peer), uneven (a large piece
    to the next rank, small ones, folded into the headers, to the others), AllGather; a call
    rank 0 enters 50 ms late (its peers' poll window runs out); two in flight, waited in
    reverse; and inputs overwritten as soon as a call returns (a call ends only once its
    pieces are read). Returns the ring messages and the reads of the peers' memory of the
    group's paths before and after, and the express count before and after."""
    rank, n = dist.get_rank(), dist.get_world_size()
    ours = freescale_group(30, shm_max_bytes=1 << 19, idle_wait="yield", host_copy_threads=threads)
    gloo = gloo_group()
    large, small = 1 << 18, 25  # float32 elements: 1 MiB, 100 B

    def paths() -> tuple[int, int]:
        rows = ours.paths()
        return sum(sum(r["ring_messages"]) for r in rows), sum(r["ring_reads"] for r in rows)

    def alltoall(split_of: Any, salt: int, group: Any, **kw: Any) -> torch.Tensor:
        send = [split_of(rank, j) for j in range(n)]
        recv = [split_of(j, rank) for j in range(n)]
        values = make_tensor((sum(send),), torch.float32, _tensor_seed(salt, 0, rank))
        out = torch.empty(sum(recv))
        work = dist.all_to_all_single(out, values, recv, send, group=group, **kw)
        return out if work is None else (work, out)

    def even(src: int, dst: int) -> int:
        return large

    def uneven(src: int, dst: int) -> int:
        return large if dst == (src + 1) % n else small

    def gathered(salt: int, group: Any) -> torch.Tensor:
        out = torch.empty(n * large)
        values = make_tensor((large,), torch.float32, _tensor_seed(salt, 1, rank))
        dist.all_gather_into_tensor(out, values, group=group)
        return out

    before, express_before = paths(), ours._ctx.express_runs
    for salt in range(3):
        _same(alltoall(even, salt, ours), alltoall(even, salt, gloo), f"even #{salt}")
        _same(alltoall(uneven, salt, ours), alltoall(uneven, salt, gloo), f"uneven #{salt}")
        _same(gathered(salt, ours), gathered(salt, gloo), f"all_gather #{salt}")
    if rank == 0:
        time.sleep(0.05)
    _same(alltoall(even, 10, ours), alltoall(even, 10, gloo), "late rank 0")
    in_flight = [alltoall(kind, 20, ours, async_op=True) for kind in (even, uneven)]
    for work, _ in reversed(in_flight):
        work.wait()
    for (_, got), kind in zip(in_flight, (even, uneven), strict=True):
        _same(got, alltoall(kind, 20, gloo), f"in flight {kind.__name__}")
    for k in range(3):
        x = torch.full((n * large,), float(100 * rank + k))
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=ours)
        x.fill_(-1.0)
        want = torch.arange(n, dtype=torch.float32).repeat_interleave(large) * 100 + k
        _same(out, want, f"overwritten input #{k}")
    after, express_after = paths(), ours._ctx.express_runs
    dist.destroy_process_group(ours)
    return {
        "ring_messages": (before[0], after[0]),
        "reads": (before[1], after[1]),
        "express": (express_before, express_after),
    }


def fsdp_trains_as_on_gloo(steps: int) -> dict[str, Any]:
    """FSDP (FULL_SHARD, CPU) trains a small MLP ``steps`` steps on the freescale world group
    and on a Gloo group from the same start; FSDP frees each AllGather's output by resizing its
    storage to 0, so the storages of a first (uncached) AllGather and AllToAll must stay
    resizable. Returns both runs' losses and the storages' resizability."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    n = dist.get_world_size()
    inp, out = torch.ones(n * 3), torch.empty(n * n * 3)
    dist.all_gather_into_tensor(out, inp)
    sent, received = torch.ones(n * 5), torch.empty(n * 5)
    dist.all_to_all_single(received, sent)
    resizable = [t.untyped_storage().resizable() for t in (inp, out, sent, received)]
    gloo = dist.new_group(backend="gloo")
    losses = {}
    for name, group in (("freescale", None), ("gloo", gloo)):
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        model = FullyShardedDataParallel(
            mlp,
            process_group=group,
            device_id=torch.device("cpu"),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            use_orig_params=True,
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        data = torch.Generator().manual_seed(100 + dist.get_rank())
        losses[name] = []
        for _ in range(steps):
            x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.item())
    dist.destroy_process_group(gloo)
    return {"resizable": resizable, **losses}
