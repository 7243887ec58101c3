"""Rank functions of the IPC path's mailbox tests (run on every rank of a real group)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.comm.ranks import _same, cuda_group, make_tensor


def ipc_mailbox_cases(seed: int) -> dict[str, Any]:
    """Small sends pushed into the peers' mailboxes (once a first collective has named
    them): three times as many collectives in flight as a mailbox has slots, uneven splits,
    sends over a slot (pulled) in between, then a mismatch on every slot in turn (the slots
    freed unread) and more collectives after it, all against locally computed results.
    Returns what the rank saw."""
    from freescale_comm import FreescaleValidationError, ipc

    rank, n = dist.get_rank(), dist.get_world_size()
    dev, group = cuda_group(cuda_path="ipc")
    slot_floats = ipc.MAILBOX_SLOT_BYTES // 4

    def splits_of(k: int) -> list[list[int]]:
        """splits[i][j]: floats rank i sends rank j; every fifth call over a slot (pulled)."""
        if k % 5 == 4:
            return [[slot_floats + 7 * i + j for j in range(n)] for i in range(n)]
        return [[(k * 13 + 3 * i + j + seed) % 300 + 1 for j in range(n)] for i in range(n)]

    def call(k: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
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
        work = dist.all_to_all_single(
            out,
            torch.cat(mine).to(dev),
            [splits[r][rank] for r in range(n)],
            splits[rank],
            group=group,
            async_op=True,
        )
        return work, out, torch.cat(sent)

    report: dict[str, Any] = {"checked": 0, "mismatches": 0}
    work, out, want = call(4)  # pulled: it names the mailboxes, mapped before it is queued
    work.wait()
    _same(out.cpu(), want, "the first call")
    report["checked"] += 1
    calls = [call(k) for k in range(3 * ipc.MAILBOX_SLOTS)]
    for k, (work, out, want) in enumerate(calls):
        work.wait()
        _same(out.cpu(), want, f"in flight #{k}")
        report["checked"] += 1
    for _ in range(ipc.MAILBOX_SLOTS + 1):
        try:
            dist.all_to_all_single(
                torch.empty(n * (2 + rank), device=dev), torch.empty(n * 2, device=dev), group=group
            )
        except FreescaleValidationError:
            report["mismatches"] += 1
    for k in range(2 * ipc.MAILBOX_SLOTS):
        work, out, want = call(100 + k)
        work.wait()
        _same(out.cpu(), want, f"after the mismatches #{k}")
        report["checked"] += 1
    torch.cuda.synchronize()
    report["pushes"] = [row["ipc_pushes"] for row in group.paths()]
    dist.destroy_process_group(group)
    return report
