"""Whether torch ops release the GIL while they run: a second thread counts meanwhile.

``python benchmarks/results/comm_gpu/gated_host_route/gil_release_check.py`` (CPU tensors; the
Python bindings that release the GIL are the same for CUDA ones).
"""

from __future__ import annotations

import sys
import threading
import time

import torch

sys.setswitchinterval(0.001)
a = torch.ones(2**28, dtype=torch.float32)
b = torch.empty_like(a)
count = [0]
stop = [False]


def spin() -> None:
    while not stop[0]:
        count[0] += 1


thread = threading.Thread(target=spin)
thread.start()
time.sleep(0.05)
for name, op in [
    ("copy_", lambda: b.copy_(a)),
    ("add_", lambda: b.add_(a)),
    ("sum().item()", lambda: a.sum().item()),
    ("clone", lambda: a.clone()),
]:
    before, t0 = count[0], time.perf_counter()
    op()
    ms = 1e3 * (time.perf_counter() - t0)
    print(f"{name}: {ms:.0f} ms, the other thread's count rose by {count[0] - before}")
stop[0] = True
thread.join()
