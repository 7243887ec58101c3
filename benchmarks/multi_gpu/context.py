"""A rank's state (``Ctx``) and the helpers every part uses: agreement, buffers, timing."""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .settings import MIB


def describe_error(err: BaseException) -> str:
    """An error and the end of its traceback, short enough for the JSON."""
    tail = traceback.format_exception(type(err), err, err.__traceback__)[-3:]
    return (f"{type(err).__name__}: {err}"[:1500] + " | " + "".join(tail)[-800:]).strip()


@dataclass
class Ctx:
    """One rank's state for a phase: its groups, buffers and what it tells the parent.

    Attributes:
        rank: this rank.
        n: ranks in the phase.
        dev: the device of its tensors.
        cuda: whether the tensors are on a GPU (not a dry run).
        args: the command line.
        phase: the phase (``settings.PHASES``) this rank runs.
        deadline: when the phase must be done (``time.time()``).
        gloo: the Gloo group of this benchmark's own barriers and agreements.
        nccl: the NCCL group (Gloo in a dry run).
        groups: backend name -> its group.
        arenas: backend name -> (input, output) symmetric buffers (``nccl_ce``).
        notes: details of the compute kernels, for the report.
        keep: objects that must live as long as the rank (a registered memory pool).
        progress_path: rank 0 writes the (part, backend) running now there.
    """

    rank: int
    n: int
    dev: Any
    cuda: bool
    args: argparse.Namespace
    phase: dict[str, Any]
    deadline: float
    gloo: Any = None
    nccl: Any = None
    groups: dict[str, Any] = field(default_factory=dict)
    arenas: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    keep: list[Any] = field(default_factory=list)
    progress_path: str | None = None
    _last: Any = None

    def backends(self) -> list[str]:
        return [b for b in self.phase["backends"] if b in self.groups]

    def progress(self, section: str, backend: str) -> None:
        """Tells the parent (rank 0 only) which backend runs now: if this process dies, the
        parent retries the rest of the phase without that backend."""
        if os.environ.get("MULTI_GPU_BENCH_CRASH") == f"{section}:{backend}" and self.rank == 1:
            os._exit(3)  # test hook for the retry path (dry runs only)
        if self.rank == 0 and self.progress_path and (section, backend) != self._last:
            self._last = (section, backend)
            # A file, not a message: the parent reads it after this process died.
            path = Path(self.progress_path)
            path.with_suffix(".tmp").write_text(json.dumps([section, backend]))
            path.with_suffix(".tmp").replace(path)


def sync(ctx: Ctx) -> None:
    """Waits for this rank's GPU work (nothing to wait for on CPU)."""
    import torch

    if ctx.cuda:
        torch.cuda.synchronize(ctx.dev)


def barrier(ctx: Ctx) -> None:
    """A barrier of every rank over the benchmark's Gloo group."""
    import torch.distributed as dist

    dist.barrier(group=ctx.gloo)


def allgather(ctx: Ctx, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (over the Gloo group)."""
    import torch.distributed as dist

    out: list[Any] = [None] * ctx.n
    dist.all_gather_object(out, obj, group=ctx.gloo)
    return out


def time_ok(ctx: Ctx, need_s: float, deadline: float) -> bool:
    """Whether every rank still has ``need_s`` before ``deadline`` (all ranks decide alike)."""
    return all(allgather(ctx, time.time() + need_s <= deadline))


def pattern(src: int, start: int, count: int, dev: Any) -> Any:
    """float32 values that name their source rank and index (exact in float32)."""
    import torch

    idx = torch.arange(start, start + count, device=dev, dtype=torch.int32)
    return ((idx + src * 7919) % 65521).to(torch.float32)


def collective(
    op: str, group: Any, out: Any, inp: Any, splits: Any = None, async_op: bool = False
) -> Any:
    """Issues ``op`` on ``group`` (``splits``: (output, input) splits of the uneven AllToAll)."""
    import torch.distributed as dist

    if op == "all_gather_into_tensor":
        return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)
    if op == "all_to_all_single":
        return dist.all_to_all_single(out, inp, group=group, async_op=async_op)
    if op == "all_to_all_single_uneven":
        out_splits, in_splits = splits
        return dist.all_to_all_single(
            out, inp, out_splits, in_splits, group=group, async_op=async_op
        )
    raise ValueError(op)


def views(ctx: Ctx, backend: str, inp: Any, out: Any) -> tuple[Any, Any]:
    """The buffers ``backend`` uses: the given ones, or same-size views of its symmetric arena
    (filled with the input's values)."""
    arena = ctx.arenas.get(backend)
    if arena is None:
        return inp, out
    a_in, a_out = arena
    need_in, need_out = inp.numel() * inp.element_size(), out.numel() * out.element_size()
    if need_in > a_in.numel() or need_out > a_out.numel():
        raise ValueError(f"{backend}: symmetric arena smaller than {need_in} / {need_out} bytes")
    v_in = a_in[:need_in].view(inp.dtype).view(inp.shape)
    v_out = a_out[:need_out].view(out.dtype).view(out.shape)
    v_in.copy_(inp)
    return v_in, v_out


def time_iters(ctx: Ctx, fn: Any, warmup: int, iters: int) -> list[float]:
    """Seconds per call: CUDA events around each call (per-call wall clock on CPU)."""
    import torch

    for _ in range(warmup):
        fn()
    if ctx.cuda:
        marks = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(iters)
        ]
        for start, end in marks:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(ctx.dev)
        return [start.elapsed_time(end) / 1e3 for start, end in marks]
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def iters_for(nbytes: int) -> tuple[int, int]:
    """(warm-up, timed) calls of a collective of ``nbytes``."""
    if nbytes <= MIB:
        return 3, 20
    if nbytes <= 32 * MIB:
        return 2, 10
    return 1, 5
