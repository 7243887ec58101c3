"""What two processes sharing one GPU cost each other: the machine behind ``comm_gpu.py``'s figures.

Two ranks on GPU 0 (two CUDA contexts, which the GPU time-slices), a Gloo group for barriers.

1. ``peer_work``: rank 0 times a loop of 48 bf16 8192^3 matmuls (the window's mean matmul),
   while rank 1 issues 26 of one kind of GPU work per window, paced over it (``overlap_rounds``:
   each window between two without, medians over rounds, a control window): D2H + H2D of
   32 MiB (copy engines over PCIe); a cross-stream event wait on a copy still running and event
   records; a device-to-device ``cudaMemcpyAsync`` of 32 MiB and of 4 KiB; the 4 KiB copy
   through ``cuMemcpyBatchAsync`` with ``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``.
2. ``messages`` (parts 2 and 3): one-way latency between the two contexts, 200 round trips
   of an 8-byte message through a page of shared page-locked memory: queued up front with
   GPU-side flags (``cuStreamWriteValue32`` / ``cuStreamWaitValue32``, the CPU never waits;
   with and without an 8-byte device-to-device copy per hop), and with the CPU polling the
   flag and only then queueing the copy out (``cpu_polled``).
3. Exchanges, the pattern of a 2-rank small collective: both ranks send at once, then wait for
   the other's message (8 bytes out through the shared page, 8 bytes in); 200 back to back
   per mode, GPU flags or CPU polled, and one at a time after a barrier (median of 50, until
   the rank's stream is done; the barrier's skew between the ranks is in it).

Writes ``shared_gpu_probe.json`` under ``--out`` and prints a table.

    python3 benchmarks/shared_gpu_probe.py --out $OUT [--rounds 4] [--parts messages]  # GPU machine
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from overlap_rounds import alternated_rounds

from freescale_comm._local_ranks import GroupSpec, run_ranks

MIB = 1 << 20
MATMULS = 48
PEER_OPS = 26  # per window, about one per staged AllToAll of 64 MiB
HOPS = 200
EXCHANGES_ONCE = 50
_PAGE = 1 << 16
_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1
_MEM_LOCATION_TYPE_DEVICE = 0x1
_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 0x1


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CopyAttributes(ctypes.Structure):
    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_hint", _Location),
        ("dst_hint", _Location),
        ("flags", ctypes.c_uint),
    ]


@functools.cache
def _memcpy_batch_async() -> Any:
    """The driver's ``cuMemcpyBatchAsync`` (CUDA 13 ABI), looked up once."""
    fn = ctypes.CDLL("libcuda.so.1").cuMemcpyBatchAsync_v2
    u64p, sizep = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t)
    fn.argtypes = [u64p, u64p, sizep, ctypes.c_size_t, ctypes.POINTER(_CopyAttributes)]
    fn.argtypes += [sizep, ctypes.c_size_t, ctypes.c_void_p]
    return fn


def _batch_copy(dst: Any, src: Any, flags: int, stream: Any) -> None:
    """One device-to-device copy through ``cuMemcpyBatchAsync`` with ``flags``."""
    here = _Location(_MEM_LOCATION_TYPE_DEVICE, dst.device.index)
    attributes = (_CopyAttributes * 1)(
        _CopyAttributes(_MEMCPY_SRC_ACCESS_ORDER_STREAM, here, here, flags)
    )
    code = _memcpy_batch_async()(
        (ctypes.c_uint64 * 1)(dst.data_ptr()),
        (ctypes.c_uint64 * 1)(src.data_ptr()),
        (ctypes.c_size_t * 1)(dst.numel() * dst.element_size()),
        1,
        attributes,
        (ctypes.c_size_t * 1)(0),
        1,
        ctypes.c_void_p(stream.cuda_stream),
    )
    if code != 0:
        raise RuntimeError(f"cuMemcpyBatchAsync_v2 failed with CUresult {code}")


def _peer_work(rounds: int) -> dict[str, Any]:
    """Part 1 on this rank (rank 0's figures; rank 1's are empty)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    host = torch.empty(32 * MIB, dtype=torch.uint8, pin_memory=True)
    src = torch.randint(0, 255, (32 * MIB,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    first, second = torch.cuda.Stream(), torch.cuda.Stream()

    def pcie() -> None:
        with torch.cuda.stream(first):
            host.copy_(src, non_blocking=True)
        with torch.cuda.stream(second):
            dst.copy_(host, non_blocking=True)

    def event_wait() -> None:
        with torch.cuda.stream(first):
            host.copy_(src, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(first)
        second.wait_event(copied)  # waits on the GPU for a copy still running
        torch.cuda.Event().record(second)

    def dtod(nbytes: int) -> Any:
        def copy() -> None:
            with torch.cuda.stream(first):
                dst[:nbytes].copy_(src[:nbytes], non_blocking=True)

        return copy

    peer_modes = {
        "pcie_32MiB": pcie,
        "event_wait": event_wait,
        "dtod_32MiB": dtod(32 * MIB),
        "dtod_4KiB": dtod(4096),
        "dtod_4KiB_batch_overlap_flag": lambda: _batch_copy(
            dst[:4096], src[:4096], _MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE, first
        ),
    }
    for _ in range(3):
        torch.mm(a, b)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(MATMULS):
        torch.mm(a, b)
    end.record()
    end.synchronize()
    window_s = start.elapsed_time(end) / 1e3
    pace = torch.tensor([window_s / PEER_OPS], dtype=torch.float64)
    dist.broadcast(pace, 0)

    def window(mode: str) -> float | None:
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            start.record()
            for _ in range(MATMULS):
                torch.mm(a, b)
            end.record()
        elif mode in peer_modes:
            for _ in range(PEER_OPS):
                peer_modes[mode]()
                time.sleep(float(pace))
        torch.cuda.synchronize()
        return start.elapsed_time(end) / MATMULS if rank == 0 else None

    measured = alternated_rounds(window, list(peer_modes), rounds, seed=7)
    if rank != 0:
        return {}
    return {
        "window_ms": 1e3 * window_s,
        "peer_ops_per_window": PEER_OPS,
        "matmul_alone_ms_median": statistics.median(measured.alone_ms),
        "slowdown_pct": measured.slowdown_pct(),
        "slowdown_pct_range": measured.slowdown_pct_range(),
    }


def _messages() -> dict[str, Any]:
    """Parts 2 and 3 on this rank: microseconds per one-way hop and per exchange, by mode (two
    runs each; one figure, the median of single exchanges, for the ``exchange_once`` modes)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from freescale_comm.cuda import _register, driver

    rank = dist.get_rank()
    name = f"/dev/shm/freescale-probe-{os.getppid()}"
    if rank == 0:
        with open(name, "wb") as f:
            f.truncate(_PAGE)
    dist.barrier()
    fd = os.open(name, os.O_RDWR)
    memory = mmap.mmap(fd, _PAGE)
    os.close(fd)
    dist.barrier()
    if rank == 0:
        os.unlink(name)
    words = np.frombuffer(memory, dtype=np.uint64)
    page = words.ctypes.data
    _register(page, _PAGE, "the probe's page")
    cu = driver()
    mapped = ctypes.c_uint64()
    cu.check(cu.host_get_device_pointer(ctypes.byref(mapped), ctypes.c_void_p(page), 0), "map")
    flag_word = [0, 8]  # uint64 index of each rank's flag (separate cache lines)
    flags = [mapped.value + 8 * w for w in flag_word]
    data = [page + 4096, page + 8192]
    me, peer = rank, 1 - rank
    buffer = torch.zeros(64, dtype=torch.uint8, device="cuda")
    other = torch.zeros_like(buffer)
    stream = torch.cuda.Stream()
    handle = ctypes.c_void_p(stream.cuda_stream)

    def send(i: int, dtod: bool) -> None:
        if dtod:
            cu.memcpy_async(other.data_ptr(), buffer.data_ptr(), 8, handle)
        cu.memcpy_async(data[me], buffer.data_ptr(), 8, handle)
        cu.write_value64(handle, flags[me], i, 0)

    def receive(i: int, cpu_polled: bool) -> None:
        if cpu_polled:
            while words[flag_word[peer]] < i:
                pass
        else:
            cu.wait_value64(handle, flags[peer], i, 0)  # GEQ
        cu.memcpy_async(buffer.data_ptr(), data[peer], 8, handle)

    def exchange(i: int, cpu_polled: bool) -> None:
        send(i, False)
        receive(i, cpu_polled)

    def fresh_flags() -> None:
        # Only once both ranks' streams are done: a peer's wait that has not yet seen the last
        # flag would never see it after a reset.
        torch.cuda.synchronize()
        dist.barrier()
        words[:64] = 0
        dist.barrier()

    hops: dict[str, list[float]] = {}
    exchanges: dict[str, list[float]] = {}
    for mode in ["exchange_gpu_flags", "exchange_cpu_polled"] * 2:
        fresh_flags()
        began = time.perf_counter()
        for i in range(1, HOPS + 1):
            exchange(i, mode == "exchange_cpu_polled")
        stream.synchronize()
        exchanges.setdefault(mode, []).append(round((time.perf_counter() - began) * 1e6 / HOPS, 1))
    for mode in ["exchange_once_gpu_flags", "exchange_once_cpu_polled"]:
        fresh_flags()
        single = []
        for i in range(1, EXCHANGES_ONCE + 1):
            torch.cuda.synchronize()
            dist.barrier()  # its skew between the ranks (tens of µs) is in the figure
            began = time.perf_counter()
            exchange(i, mode == "exchange_once_cpu_polled")
            stream.synchronize()
            single.append((time.perf_counter() - began) * 1e6)
        exchanges[mode] = [round(statistics.median(single), 1)]
    for mode in ["gpu_flags", "gpu_flags_dtod", "cpu_polled"] * 2:
        fresh_flags()
        began = time.perf_counter()
        for i in range(1, HOPS + 1):
            if rank == 0:
                send(i, mode == "gpu_flags_dtod")
                receive(i, mode == "cpu_polled")
            else:
                receive(i, mode == "cpu_polled")
                send(i, mode == "gpu_flags_dtod")
        stream.synchronize()
        hops.setdefault(mode, []).append(round((time.perf_counter() - began) * 1e6 / HOPS / 2, 1))
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.cudart().cudaHostUnregister(page)
    return {"hop_us": hops, "exchange_us": exchanges}


def _rank(rounds: int, parts: list[str]) -> dict[str, Any]:
    import torch

    torch.cuda.set_device(0)
    report: dict[str, Any] = {}
    if "peer_work" in parts:
        report["peer_work"] = _peer_work(rounds)
    if "messages" in parts:
        report.update(_messages())
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--parts", nargs="+", choices=["peer_work", "messages"], default=["peer_work", "messages"]
    )
    args = parser.parse_args(argv)
    spec = GroupSpec(2, "gloo", device="cuda", threads=None)
    ranks = run_ranks(spec, _rank, args.rounds, args.parts, timeout_s=300)
    report = {"rounds": args.rounds, "ranks": ranks}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "shared_gpu_probe.json").write_text(json.dumps(report, indent=1))
    if "peer_work" in args.parts:
        work = ranks[0]["peer_work"]
        print(f"matmul alone {work['matmul_alone_ms_median']:.3f} ms; rank 1's work beside it:")
        for mode, pct in work["slowdown_pct"].items():
            low, high = work["slowdown_pct_range"][mode]
            print(f"  {mode:<30} {pct:+6.1f}%  (rounds {low:+.1f} to {high:+.1f})")
    for key, unit in (("hop_us", "us per one-way hop"), ("exchange_us", "us per exchange")):
        for mode, figures in ranks[0].get(key, {}).items():
            slower = [max(a, b) for a, b in zip(figures, ranks[1][key][mode], strict=True)]
            print(f"{mode:<26} {' / '.join(f'{f:.1f}' for f in slower)} {unit} (slower rank)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
