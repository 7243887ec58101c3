"""Rank functions of the IPC path's mailbox tests (run on every rank of a real group)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.comm.ranks import _same, cuda_group, make_tensor, threads_advancing


def ipc_mailbox_cases(seed: int, lag_cycles: int = 0) -> dict[str, Any]:
    """Small sends pushed into the peers' mailboxes (once a first collective has named
    them): three times as many collectives in flight as a mailbox has slots, uneven splits,
    sends over a slot (pulled) in between, then a mismatch on every slot in turn (the slots
    freed unread) and more collectives after it, all against locally computed results.
    ``lag_cycles``: the collectives in flight are all started while the GPU sleeps this long
    (none of them queued, their pushes at once). Returns what the rank saw."""
    from freescale_comm import FreescaleValidationError, ipc

    rank, n = dist.get_rank(), dist.get_world_size()
    dev, group = cuda_group(cuda_path="ipc")
    slot_floats = ipc.MAILBOX_SLOT_BYTES // 4

    def splits_of(k: int) -> list[list[int]]:
        """splits[i][j]: floats rank i sends rank j; every fifth call over a slot (pulled)."""
        if k % 5 == 4:
            return [[slot_floats + 7 * i + j for j in range(n)] for i in range(n)]
        return [[(k * 13 + 3 * i + j + seed) % 300 + 1 for j in range(n)] for i in range(n)]

    def prepare(k: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Call ``k``'s input and output on the GPU, and what it must receive."""
        splits = splits_of(k)
        piece_seed = seed + 97 * k
        sent = [
            make_tensor((splits[r][rank],), torch.float32, piece_seed + 7 * r + 1000 * rank)
            for r in range(n)
        ]
        mine = [
            make_tensor((splits[rank][j],), torch.float32, piece_seed + 7 * rank + 1000 * j)
            for j in range(n)
        ]
        out = torch.full((sum(splits[r][rank] for r in range(n)),), -1.0, device=dev)
        return k, torch.cat(mine).to(dev), out, torch.cat(sent)

    def launch(
        k: int, inp: torch.Tensor, out: torch.Tensor, want: torch.Tensor
    ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        splits = splits_of(k)
        work = dist.all_to_all_single(
            out, inp, [splits[r][rank] for r in range(n)], splits[rank], group=group, async_op=True
        )
        return work, out, want

    def call(k: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
        return launch(*prepare(k))

    report: dict[str, Any] = {"checked": 0, "mismatches": 0}
    work, out, want = call(4)  # pulled: it names the mailboxes, mapped before it is queued
    work.wait()
    _same(out.cpu(), want, "the first call")
    report["checked"] += 1
    prepared = [prepare(k) for k in range(3 * ipc.MAILBOX_SLOTS)]
    if lag_cycles:
        torch.cuda._sleep(lag_cycles)
    calls = [launch(*p) for p in prepared]
    for k, (work, out, want) in enumerate(calls):
        work.wait()
        _same(out.cpu(), want, f"in flight #{k}")
        report["checked"] += 1
    # Which of those pushed depends on when each receiver read its slots (an unread one is
    # pulled); from here on every receiver has read a slot before it is pushed into again.
    report["pushes_in_flight"] = [row["ipc_pushes"] for row in group.paths()]
    for _ in range(ipc.MAILBOX_SLOTS + 1):
        torch.cuda.synchronize()  # the slots freed unread by the previous mismatch
        dist.barrier(group=group)
        try:
            dist.all_to_all_single(
                torch.empty(n * (2 + rank), device=dev), torch.empty(n * 2, device=dev), group=group
            )
        except FreescaleValidationError:
            report["mismatches"] += 1
    torch.cuda.synchronize()
    dist.barrier(group=group)
    for k in range(2 * ipc.MAILBOX_SLOTS):
        work, out, want = call(100 + k)
        work.wait()
        _same(out.cpu(), want, f"after the mismatches #{k}")
        report["checked"] += 1
    torch.cuda.synchronize()
    report["pushes"] = [row["ipc_pushes"] for row in group.paths()]
    dist.destroy_process_group(group)
    return report


def ipc_lagging_receiver_cases(seed: int) -> dict[str, Any]:
    """A mismatch while the receiver's GPU lags a mailbox's worth of pushes behind: rank 1's
    stream sleeps, both ranks push ``MAILBOX_SLOTS`` small collectives, then a mismatched one
    whose push reuses the first one's slot. Freeing that slot must not let the failed push
    overwrite bytes the lagging GPU has yet to read, nor set its "read" flag back (later
    collectives through the same slot then wait forever). Returns how many were checked."""
    from freescale_comm import FreescaleValidationError, ipc

    rank, n = dist.get_rank(), dist.get_world_size()
    dev, group = cuda_group(timeout_s=30, cuda_path="ipc")

    def prepare(k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Call ``k``'s input and output on the GPU, and what it must receive."""
        sent = [
            make_tensor((8,), torch.float32, seed + 97 * k + 7 * r + 1000 * rank) for r in range(n)
        ]
        mine = [
            make_tensor((8,), torch.float32, seed + 97 * k + 7 * rank + 1000 * j) for j in range(n)
        ]
        return torch.cat(mine).to(dev), torch.full((8 * n,), -1.0, device=dev), torch.cat(sent)

    def call(inp: torch.Tensor, out: torch.Tensor, want: torch.Tensor) -> tuple[Any, ...]:
        return dist.all_to_all_single(out, inp, group=group, async_op=True), out, want

    first = call(*prepare(0))  # names the mailboxes; pushes start with the next call
    first[0].wait()
    _same(first[1].cpu(), first[2], "the first call")
    # Every input on the GPU before the sleep: a copy from pageable memory would wait for it.
    prepared = [prepare(1 + k) for k in range(ipc.MAILBOX_SLOTS)]
    # Every rank sends 2 floats to every rank; rank 1 expects 3 from each: a mismatch on every
    # rank, whose pushes go into the slots of the first of those calls.
    splits = [2 + (rank == 1)] * n
    bad, bad_out = torch.full((2 * n,), 9999.0, device=dev), torch.empty(sum(splits), device=dev)
    torch.cuda.synchronize()
    dist.barrier(group=group)
    if rank == 1:
        torch.cuda._sleep(1_000_000_000)  # about half a second behind rank 0
    calls = [call(*p) for p in prepared]
    try:
        dist.all_to_all_single(bad_out, bad, splits, [2] * n, group=group)
        raise AssertionError("the mismatch passed")
    except FreescaleValidationError:
        pass
    checked = 0
    for k, (work, out, want) in enumerate(calls):
        work.wait()
        _same(out.cpu(), want, f"in flight behind the lag #{k}")
        checked += 1
    for k in range(2 * ipc.MAILBOX_SLOTS):  # through every slot again, the failed one's too
        work, out, want = call(*prepare(100 + k))
        work.wait()
        _same(out.cpu(), want, f"after the mismatch #{k}")
        checked += 1
    torch.cuda.synchronize()
    dist.destroy_process_group(group)
    return {"checked": checked}


def ipc_mismatch_with_cpu_tensors_cases(seed: int) -> dict[str, Any]:
    """A rank that passes CPU tensors where its peers pass CUDA ones (each rank in turn): every
    rank fails the verdict, and the CPU rank frees the mailbox slots the others pushed into
    although its own call is off the IPC path. Then ``2 * MAILBOX_SLOTS`` small CUDA calls
    through every slot (a slot left unfreed held the sender's next push to it until the group
    timeout). Returns how many were checked and how many mismatches raised."""
    from freescale_comm import FreescaleValidationError, ipc

    rank, n = dist.get_rank(), dist.get_world_size()
    dev, group = cuda_group(timeout_s=20, cuda_path="ipc")

    def call(k: int) -> None:
        sent = [
            make_tensor((8,), torch.float32, seed + 97 * k + 7 * r + 1000 * rank) for r in range(n)
        ]
        mine = [
            make_tensor((8,), torch.float32, seed + 97 * k + 7 * rank + 1000 * j) for j in range(n)
        ]
        out = torch.full((8 * n,), -1.0, device=dev)
        dist.all_to_all_single(out, torch.cat(mine).to(dev), group=group)
        _same(out.cpu(), torch.cat(sent), f"call {k}")

    call(0)  # names the mailboxes; pushes start with the next call
    report = {"checked": 1, "mismatches": 0}
    for cpu_rank in range(n):
        device = "cpu" if rank == cpu_rank else dev
        try:
            out = torch.empty(8 * n, device=device)
            dist.all_to_all_single(out, torch.ones(8 * n, device=device), group=group)
        except FreescaleValidationError:
            report["mismatches"] += 1
        for k in range(2 * ipc.MAILBOX_SLOTS):
            call(1 + k + 100 * cpu_rank)
            report["checked"] += 1
    torch.cuda.synchronize()
    dist.destroy_process_group(group)
    return report


def ipc_late_sequence_cases(seed: int) -> dict[str, Any]:
    """Collectives numbered from past 2^31 on a new group, whose flags are all 0: a pulled
    collective whose sender's inputs come behind GPU work, then pushed ones. A 32-bit flag
    compare would let the waits pass at once and read inputs not yet produced. Returns how
    many were checked."""
    import itertools

    rank, n = dist.get_rank(), dist.get_world_size()
    dev, group = cuda_group(timeout_s=30, cuda_path="ipc")
    group._ctx._seq = itertools.count(2**31 + 10)
    checked = 0
    for k, floats in enumerate([1 << 17, 8, 8, 1 << 17]):  # pulled (512 KiB), pushed, ...
        x = torch.zeros(n * floats, device=dev)
        if rank == 0:
            torch.cuda._sleep(300_000_000)  # its inputs are written after a GPU sleep
        x.fill_(rank + 10 * k + 1)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        want = torch.cat([torch.full((floats,), r + 10 * k + 1.0) for r in range(n)])
        _same(out.cpu(), want, f"collective #{k} past 2^31")
        checked += 1
    torch.cuda.synchronize()
    dist.destroy_process_group(group)
    return {"checked": checked}


def ipc_end_event_cases() -> dict[str, Any]:
    """Synchronous IPC collectives, left to their CUDA end event once ``wait`` returned: how
    many of 20 back to back handed it to a watcher thread to be finished, and (each behind a
    GPU sleep, so the call returns first, its handle kept) how soon after the GPU a future
    asked for late, ``is_completed`` and ``synchronize`` saw the end."""
    import time

    from freescale_comm import cuda

    rank, n = dist.get_rank(), dist.get_world_size()
    finishing = [0]  # watches that finish a collective (the IPC gate's only wake a thread)
    original = cuda.StreamWatcher.watch

    def counting(self: Any, event: Any, then: Any = None) -> None:
        finishing[0] += then is not None
        original(self, event, then)

    # Patched before the group's first collective, which binds the IPC gate's watch.
    cuda.StreamWatcher.watch = counting
    try:
        dev, group = cuda_group(cuda_path="ipc")

        def pair() -> tuple[torch.Tensor, torch.Tensor]:
            sent = torch.arange(2 * n, dtype=torch.float32, device=dev) + 100 * rank
            return sent, torch.empty_like(sent)

        def expected() -> torch.Tensor:
            return torch.tensor(
                [100 * j + 2 * rank + k for j in range(n) for k in range(2)], device=dev
            )

        def synchronous(received: torch.Tensor, sent: torch.Tensor, sleep: bool = False) -> Any:
            """A call its caller drives (as ``async_op=False`` makes it), handle kept."""
            if sleep:
                torch.cuda._sleep(600_000_000)  # about 0.3 s
            opts = dist.AllToAllOptions()
            opts.asyncOp = False
            work = group.alltoall_base(received, sent, [], [], opts)
            work.wait()
            return work

        report: dict[str, Any] = {}
        sent, received = pair()
        synchronous(received, sent)  # maps the peers' mailboxes
        torch.cuda.synchronize()
        finishing[0] = 0
        for _ in range(20):
            synchronous(received, sent)
        report["finishing_watches_of_20_calls"] = finishing[0]
        torch.cuda.synchronize()
        report["correct"] = torch.equal(received, expected())

        futures_after_gpu = []
        for _ in range(3):  # a poll each second would be this prompt one time in five
            work = synchronous(received, sent, sleep=True)
            future = work.get_future()
            torch.cuda.synchronize()
            gpu_done = time.monotonic()
            future.wait()
            futures_after_gpu.append(time.monotonic() - gpu_done)
            report["future_correct"] = torch.equal(future.value()[0], expected())
        report["futures_after_gpu_s"] = futures_after_gpu

        work = synchronous(received, sent, sleep=True)
        torch.cuda.synchronize()
        report["is_completed_after_gpu"] = work.is_completed()

        start, began = time.monotonic(), torch.cuda.Event(enable_timing=True)
        began.record()
        work = synchronous(received, sent, sleep=True)
        ended = torch.cuda.Event(enable_timing=True)
        ended.record()
        work.synchronize()
        returned = time.monotonic() - start
        ended.synchronize()
        report["synchronize_after_gpu_s"] = returned - began.elapsed_time(ended) / 1e3
    finally:
        cuda.StreamWatcher.watch = original
    dist.destroy_process_group(group)
    return report


def ipc_asynchronous_calls_driven_by_their_wait(rounds: int) -> dict[str, Any]:
    """Asynchronous IPC AllToAlls that rank 1 calls 50 ms late, each waited for at once and
    compared with the expected values. Returns per call whether the calling thread advanced it
    (its ``wait`` drove it until sealed), and whether every result was right."""
    import threading
    import time

    rank, n = dist.get_rank(), dist.get_world_size()
    dev, group = cuda_group(cuda_path="ipc")
    sent = torch.arange(2 * n, dtype=torch.float32, device=dev) + 100 * rank
    received = torch.empty_like(sent)
    values = [100 * j + 2 * rank + k for j in range(n) for k in range(2)]
    want = torch.tensor(values, dtype=torch.float32, device=dev)
    dist.all_to_all_single(received, sent, group=group)  # maps the peers' mailboxes
    torch.cuda.synchronize()
    caller, driven_here, correct = threading.current_thread().name, [], True
    for _ in range(rounds):
        received.zero_()
        if rank == 1:
            time.sleep(0.05)
        with threads_advancing() as names:
            dist.all_to_all_single(received, sent, group=group, async_op=True).wait()
        driven_here.append(caller in names)
        correct = correct and torch.equal(received, want)
    torch.cuda.synchronize()
    dist.destroy_process_group(group)
    return {"driven_here": driven_here, "correct": correct}
