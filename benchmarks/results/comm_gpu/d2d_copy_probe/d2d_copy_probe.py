"""Does a same-device D2D ``cuMemcpyAsync`` slow a bf16 matmul, and does ``cuMemcpyBatchAsync``
with ``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE`` avoid it?

One process: matmuls on the current stream, four copies beside each on a side stream; medians
of each window's matmuls, variants alternated; then which names the profiler gives the copies.
Needs CUDA and ``cuda-bindings``:

    python3 benchmarks/results/comm_gpu/d2d_copy_probe/d2d_copy_probe.py
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from cuda.bindings import driver as cu
from torch.profiler import ProfilerActivity, profile

MIB = 1 << 20
MATMULS = 24  # per window
ROUNDS = 5  # windows per variant
COPIES = 4  # beside each matmul


def _check(result: tuple, call: str) -> None:
    if result[0] != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{call}: {result}")


def _attributes(flags: int) -> cu.CUmemcpyAttributes:
    """Stream-ordered copy attributes on device 0 with ``flags``."""
    where = cu.CUmemLocation()
    where.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    where.id = 0
    attributes = cu.CUmemcpyAttributes()
    attributes.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    attributes.srcLocHint = where
    attributes.dstLocHint = where
    attributes.flags = flags
    return attributes


def main() -> None:
    device = torch.device("cuda", 0)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    src = torch.empty(256 * MIB, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    side = torch.cuda.Stream()
    dst_ptr, src_ptr = cu.CUdeviceptr(dst.data_ptr()), cu.CUdeviceptr(src.data_ptr())

    def plain(nbytes: int) -> None:
        _check(cu.cuMemcpyAsync(dst_ptr, src_ptr, nbytes, side.cuda_stream), "cuMemcpyAsync")

    def batch(flags: int, nbytes: int) -> None:
        result = cu.cuMemcpyBatchAsync(
            [dst_ptr], [src_ptr], [nbytes], 1, [_attributes(flags)], [0], 1, side.cuda_stream
        )
        _check(result, "cuMemcpyBatchAsync")

    variants: dict[str, Callable[[int], None] | None] = {
        "none": None,
        "cuMemcpyAsync": plain,
        "batch_default": lambda n: batch(0, n),
        "batch_prefer_overlap": lambda n: batch(1, n),
    }

    def window(copy: Callable[[int], None] | None, nbytes: int) -> float:
        """The median matmul time (ms) of one window with ``copy`` beside each matmul."""
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(MATMULS + 1)]
        marks[0].record()
        for i in range(MATMULS):
            if copy is not None:
                side.wait_event(marks[i])
                for _ in range(COPIES):
                    copy(nbytes)
            torch.mm(a, b)
            marks[i + 1].record()
        torch.cuda.synchronize()
        return statistics.median(marks[i].elapsed_time(marks[i + 1]) for i in range(MATMULS))

    for nbytes in (64 * MIB, 256 * MIB):
        for name, copy in variants.items():
            if copy is None:
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(side)
            copy(nbytes)
            end.record(side)
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
            rate = nbytes / ms / 1e6
            print(f"{nbytes >> 20} MiB {name}: one copy alone {ms:.3f} ms ({rate:.0f} GB/s)")
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(ROUNDS):
            for name, copy in variants.items():
                times[name].append(window(copy, nbytes))
        alone = statistics.median(times["none"])
        slowdowns = ", ".join(
            f"{name} {100 * (statistics.median(t) / alone - 1):+.2f}%"
            for name, t in times.items()
            if name != "none"
        )
        print(f"{nbytes >> 20} MiB: matmul alone {alone:.3f} ms; {slowdowns}", flush=True)

    for name, copy in variants.items():
        if copy is None:
            continue
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            copy(64 * MIB)
            torch.cuda.synchronize()
        cuda_events = (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        print(f"profiler {name}: {sorted({e.name for e in cuda_events})}")


if __name__ == "__main__":
    main()
