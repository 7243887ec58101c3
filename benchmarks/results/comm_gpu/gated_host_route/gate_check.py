"""The gated host route's stream semantics and result, and a host function's latency.

Run from the project root at ae3afa3, whose ``benchmarks/comm_gpu.py`` has ``_HostGate`` and
``_gated_through_host``: ``torchrun --nproc-per-node 2 <this file>`` (2 ranks on GPU 0).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, "benchmarks")
from comm_gpu import _gated_through_host, _HostGate  # at ae3afa3

import freescale_comm  # noqa: F401 (registers the backend)

dist.init_process_group("freescale")
rank = dist.get_rank()
torch.cuda.set_device(0)
dev = torch.device("cuda", 0)
n = 16
x = torch.arange(n, device=dev, dtype=torch.float32) + 1000 * rank
y = torch.zeros_like(x)
call = _gated_through_host(y, x, dist.group.WORLD)
for _ in range(5):
    call()
torch.cuda.synchronize()
expected = torch.cat(
    [torch.arange(n // 2, dtype=torch.float32) + rank * (n // 2) + 1000 * peer for peer in (0, 1)]
)
print(rank, "correct", torch.equal(y.cpu(), expected), flush=True)

# Behind ~50 ms of GPU work: the call returns at once, the result is right once synchronized.
x.add_(1)
y.zero_()
dist.barrier()
torch.cuda._sleep(int(50e-3 * 1.8e9))
t0 = time.perf_counter()
call()
t1 = time.perf_counter()
torch.cuda.synchronize()
t2 = time.perf_counter()
print(
    rank,
    f"behind 50 ms of work: returned after {1e3 * (t1 - t0):.2f} ms, "
    f"done after {1e3 * (t2 - t0):.1f} ms, correct",
    torch.equal(y.cpu(), expected + 1),
    flush=True,
)

# A bare gate opened at once, on an idle stream: until the stream has passed it.
gate = _HostGate()
times = []
for _ in range(50):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gate.close_on(torch.cuda.current_stream().cuda_stream)
    gate.open()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
median_us = 1e6 * statistics.median(times)
print(rank, f"bare gate, opened at once: median {median_us:.0f} us", flush=True)
dist.destroy_process_group()
