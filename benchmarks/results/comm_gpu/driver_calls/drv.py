"""Cost per driver call through ctypes (freescale_comm.cuda.driver) and torch's event calls."""

import ctypes
import time

import torch

from freescale_comm.cuda import driver

CALLS = 20000


def per_call(label: str, body, stream: torch.cuda.Stream) -> None:
    start = time.perf_counter()
    for index in range(CALLS):
        body(index)
    stream.synchronize()
    print(f"{label} {(time.perf_counter() - start) / CALLS * 1e6:.2f} us")


torch.zeros(1, device="cuda")
cu = driver()
cu.bind(0)
flags = torch.zeros(1 << 18, dtype=torch.int64, device="cuda")
stream = torch.cuda.Stream()
handle, base = ctypes.c_void_p(stream.cuda_stream), flags.data_ptr()
marked = torch.cuda.Event()
marked.record(stream)
for _ in range(3):
    per_call("ctypes write_value64", lambda i: cu.write_value64(handle, base, i, 0), stream)
    per_call("ctypes memcpy 64B", lambda i: cu.memcpy_async(base + 4096, base, 64, handle), stream)
    per_call("ctypes bind+restore", lambda i: cu.restore(cu.bind(0)), stream)
    per_call("torch Event()+record", lambda i: torch.cuda.Event().record(stream), stream)
    per_call("torch wait_event", lambda i: stream.wait_event(marked), stream)
