"""Part 2, correctness: every own collective of freescale (IPC, direct and staged) on CUDA tensors,
float32 / bfloat16 / int64, against NCCL's result on the same inputs and the expected values."""

from __future__ import annotations

import time
from typing import Any

from .context import Ctx, allgather, barrier, describe_error
from .settings import FREESCALE


def _values(shape: tuple[int, ...], dtype: Any, seed: int, dev: Any) -> Any:
    import torch

    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        data = torch.randn(shape, generator=gen) * 100
    else:
        data = torch.randint(-(2**40), 2**40, shape, generator=gen)
    return data.to(dtype).to(dev)


def _check_case(ctx: Ctx, name: str, fs: Any, dtype: Any, case: int) -> dict[str, Any]:
    """Runs one collective on NCCL and on freescale with the same inputs; compares both results
    with each other and with the expected values."""
    import torch

    n, dev = ctx.n, ctx.dev
    gen = torch.Generator().manual_seed(case)
    rows = int(torch.randint(1, 9, (1,), generator=gen))

    def piece(src: int, dst: int, k: int) -> Any:
        return _values((k, 3), dtype, 100_000 * case + 1000 * src + dst, dev)

    def empty(k: int) -> Any:
        return torch.full((k, 3), -7, dtype=dtype, device=dev)

    splits = [[(i + 2 * j + case) % 4 for j in range(n)] for i in range(n)]  # has zeros
    results: dict[str, Any] = {}
    results["nccl"] = "not run (no NCCL group)"
    for which, group in (("nccl", ctx.nccl), ("fs", fs)):
        if group is None:
            continue
        try:
            results[which] = _run_case(ctx, name, group, rows, piece, empty, splits)
        except Exception as err:
            if which == "fs":
                raise
            results[which] = describe_error(err)
    fs_out, want = results["fs"]
    if isinstance(results["nccl"], str):
        return {
            "equal_expected": bool(torch.equal(fs_out, want)),
            "equal_nccl": None,
            "nccl_error": results["nccl"],
        }
    return {
        "equal_nccl": bool(torch.equal(fs_out, results["nccl"][0])),
        "equal_expected": bool(torch.equal(fs_out, want)),
        "nccl_equal_expected": bool(torch.equal(results["nccl"][0], want)),
    }


def _run_case(
    ctx: Ctx, name: str, group: Any, rows: int, piece: Any, empty: Any, splits: list[list[int]]
) -> tuple[Any, Any]:
    import torch
    import torch.distributed as dist

    n, rank = ctx.n, ctx.rank
    if name == "all_gather_into_tensor":
        out = empty(n * rows)
        dist.all_gather_into_tensor(out, piece(rank, rank, rows), group=group)
        want = torch.cat([piece(j, j, rows) for j in range(n)])
    elif name == "all_gather":
        outs = [empty(rows) for _ in range(n)]
        dist.all_gather(outs, piece(rank, rank, rows), group=group)
        out, want = torch.cat(outs), torch.cat([piece(j, j, rows) for j in range(n)])
    elif name == "all_gather_into_tensor_coalesced":
        import torch.distributed._functional_collectives as funcol

        ins = [piece(rank, rank, rows), piece(rank, rank + n, rows + 1)]
        got = funcol.all_gather_into_tensor_coalesced(ins, group)
        out = torch.cat([funcol.wait_tensor(t) for t in got])
        want = torch.cat(
            [
                torch.cat([piece(j, j, rows) for j in range(n)]),
                torch.cat([piece(j, j + n, rows + 1) for j in range(n)]),
            ]
        )
    elif name in ("all_to_all_single_even", "all_to_all_single_async"):
        send = torch.cat([piece(rank, j, rows) for j in range(n)])
        out = empty(n * rows)
        work = dist.all_to_all_single(out, send, group=group, async_op=name.endswith("async"))
        if work is not None:
            work.wait()
        want = torch.cat([piece(j, rank, rows) for j in range(n)])
    elif name == "all_to_all_single_uneven":
        send = torch.cat([piece(rank, j, splits[rank][j]) for j in range(n)])
        out = empty(sum(splits[j][rank] for j in range(n)))
        dist.all_to_all_single(
            out, send, [splits[j][rank] for j in range(n)], splits[rank], group=group
        )
        want = torch.cat([piece(j, rank, splits[j][rank]) for j in range(n)])
    elif name == "all_to_all":
        ins = [piece(rank, j, splits[rank][j]) for j in range(n)]
        outs = [empty(splits[j][rank]) for j in range(n)]
        dist.all_to_all(outs, ins, group=group)
        out = torch.cat(outs)
        want = torch.cat([piece(j, rank, splits[j][rank]) for j in range(n)])
    else:
        raise ValueError(name)
    return out.cpu(), want.cpu()


CHECKS = (
    "all_gather_into_tensor",
    "all_gather",
    "all_gather_into_tensor_coalesced",
    "all_to_all_single_even",
    "all_to_all_single_uneven",
    "all_to_all",
    "all_to_all_single_async",
)


def run_correctness(ctx: Ctx, deadline: float) -> dict[str, Any]:
    """Part 2: every check per freescale path and dtype, against NCCL and the expected values."""
    import torch

    rows = []
    case = 0
    for path in (b for b in FREESCALE if b in ctx.backends()):
        ctx.progress("correctness", path)
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            checks = {}
            for name in CHECKS:
                case += 1
                barrier(ctx)
                try:
                    local: Any = _check_case(ctx, name, ctx.groups[path], dtype, case)
                except Exception as err:
                    local = {"error": describe_error(err)}
                per_rank = allgather(ctx, local)
                ok = all(
                    "error" not in r and r["equal_expected"] and r["equal_nccl"] is not False
                    for r in per_rank
                )
                no_ref = any(r.get("equal_nccl") is None for r in per_rank)
                checks[name] = (
                    {"ok": True, "nccl_reference": not no_ref}
                    if ok and not no_ref
                    else {"ok": ok, "nccl_reference": not no_ref, "ranks": per_rank}
                )
            rows.append(
                {
                    "path": path,
                    "dtype": str(dtype).removeprefix("torch."),
                    "checks": checks,
                    "all_ok": all(c["ok"] for c in checks.values()),
                }
            )
            if time.time() > deadline:
                rows.append({"skipped": "time budget"})
                return {"rows": rows, "all_ok": False}
    return {"rows": rows, "all_ok": all(r.get("all_ok", False) for r in rows)}
