"""Cost per driver call through ctypes (freescale_comm.cuda.driver) and torch's event record."""
import ctypes, time, torch
from freescale_comm.cuda import driver
torch.cuda.init(); torch.zeros(1, device="cuda")
cu = driver(); cu.bind(0)
buf = torch.zeros(1 << 18, dtype=torch.int64, device="cuda")
s = torch.cuda.Stream(); h = ctypes.c_void_p(s.cuda_stream); a = buf.data_ptr()
n = 20000
for _ in range(3):
    t = time.perf_counter()
    for i in range(n): cu.check(cu.write_value64(h, a, i, 0), "w")
    s.synchronize(); print(f"ctypes write_value64 {(time.perf_counter()-t)/n*1e6:.2f} us")
    t = time.perf_counter()
    for i in range(n): cu.check(cu.memcpy_async(a + 4096, a, 64, h), "m")
    s.synchronize(); print(f"ctypes memcpy 64B {(time.perf_counter()-t)/n*1e6:.2f} us")
    t = time.perf_counter()
    for i in range(n): cu.restore(cu.bind(0))
    print(f"ctypes bind+restore {(time.perf_counter()-t)/n*1e6:.2f} us")
    t = time.perf_counter()
    for i in range(n):
        e = torch.cuda.Event(); e.record(s)
    s.synchronize(); print(f"torch Event()+record {(time.perf_counter()-t)/n*1e6:.2f} us")
    e = torch.cuda.Event(); e.record(s)
    t = time.perf_counter()
    for i in range(n): s.wait_event(e)
    print(f"torch wait_event {(time.perf_counter()-t)/n*1e6:.2f} us")
