"""Does a same-device D2D cuMemcpyAsync slow a bf16 matmul (SM copy), and does cuMemcpyBatchAsync
with CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE avoid it? One process, matmuls on one stream,
copies on another; medians of alternated rounds; and which copies CUPTI reports as kernels."""
import statistics, sys, time
import torch
from cuda.bindings import driver as cu

torch.cuda.init(); dev = torch.device("cuda", 0)
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16); b = torch.randn_like(a)
MiB = 1 << 20
src = torch.empty(256 * MiB, dtype=torch.uint8, device=dev); dst = torch.empty_like(src)
side = torch.cuda.Stream()
N = 24

def attrs(flag):
    at = cu.CUmemcpyAttributes()
    at.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    loc = cu.CUmemLocation(); loc.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE; loc.id = 0
    at.srcLocHint = loc; at.dstLocHint = loc; at.flags = flag
    return at

def batch(flag, nbytes):
    h = side.cuda_stream
    args = ([cu.CUdeviceptr(dst.data_ptr())], [cu.CUdeviceptr(src.data_ptr())], [nbytes], 1, [attrs(flag)], [0], 1)
    r = cu.cuMemcpyBatchAsync(*args, h)
    if r[0] != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpyBatchAsync: {r}")

def plain(nbytes):
    r = cu.cuMemcpyAsync(cu.CUdeviceptr(dst.data_ptr()), cu.CUdeviceptr(src.data_ptr()), nbytes, side.cuda_stream)
    if r[0] != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpyAsync: {r}")

def window(copy, nbytes):
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(N + 1)]
    marks[0].record()
    for i in range(N):
        if copy is not None:
            side.wait_event(marks[i])
            for _ in range(4):
                copy(nbytes)
        torch.mm(a, b); marks[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(marks[i].elapsed_time(marks[i + 1]) for i in range(N))

variants = {"none": None, "cuMemcpyAsync": plain, "batch_default": lambda n: batch(0, n),
            "batch_prefer_overlap": lambda n: batch(1, n)}
for nbytes in (64 * MiB, 256 * MiB):
    t0 = time.perf_counter(); c0 = torch.cuda.Event(enable_timing=True); c1 = torch.cuda.Event(enable_timing=True)
    for name, fn in list(variants.items())[1:]:
        with torch.cuda.stream(side):
            c0.record(side); fn(nbytes); c1.record(side)
        torch.cuda.synchronize()
        print(f"{nbytes >> 20} MiB {name}: one copy alone {c0.elapsed_time(c1):.3f} ms ({nbytes / c0.elapsed_time(c1) / 1e6:.0f} GB/s)")
    res = {k: [] for k in variants}
    for _ in range(5):
        for name, fn in variants.items():
            res[name].append(window(fn, nbytes))
    base = statistics.median(res["none"])
    print(f"{nbytes >> 20} MiB: matmul alone {base:.3f} ms; " + ", ".join(
        f"{k} {100 * (statistics.median(v) / base - 1):+.2f}%" for k, v in res.items() if k != "none"), flush=True)

from torch.profiler import profile, ProfilerActivity
for name, fn in list(variants.items())[1:]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.cuda.stream(side):
            fn(64 * MiB)
        torch.cuda.synchronize()
    names = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    print(f"profiler {name}: {names}")
