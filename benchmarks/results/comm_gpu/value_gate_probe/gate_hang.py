"""torchrun --nproc-per-node 2: the gated route back to back at 1 MiB, with a watchdog that dumps
native stacks (gdb) and the route's state if a loop hangs."""
import os, sys, time, threading, subprocess, queue, ctypes
sys.path.insert(0, "out/dev/gate2")
import torch, torch.distributed as dist
import freescale_comm  # noqa
from comm_gpu import _HostGate

dist.init_process_group("freescale")
rank = dist.get_rank(); torch.cuda.set_device(0); dev = torch.device("cuda", 0)
out = os.environ.get("OUT", "/tmp")
nbytes = int(os.environ.get("GATE_BYTES", str(1 << 20)))
x = torch.ones(nbytes // 4, device=dev); y = torch.empty_like(x)
host_x = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
host_y = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
jobs = queue.SimpleQueue(); gate = _HostGate()
state = {"put": 0, "taken": 0, "exchanged": 0, "posted": 0, "phase": "start"}
def exchange():
    while True:
        copied, g = jobs.get(); state["taken"] += 1
        copied.synchronize()
        dist.all_to_all_single(host_y, host_x, group=dist.group.WORLD); state["exchanged"] += 1
        g.open(); state["posted"] += 1
threading.Thread(target=exchange, daemon=True).start()
def call():
    stream = torch.cuda.current_stream()
    state["phase"] = "d2h"; host_x.copy_(x, non_blocking=True)
    copied = torch.cuda.Event(); copied.record(stream)
    state["phase"] = "gate"; gate.close_on(stream.cuda_stream)
    state["phase"] = "h2d"; y.copy_(host_y, non_blocking=True)
    jobs.put((copied, gate)); state["put"] += 1; state["phase"] = "put"
done = threading.Event()
def watchdog():
    if done.wait(25): return
    libc = ctypes.CDLL(None); v = ctypes.c_int()
    libc.sem_getvalue(ctypes.c_void_p(gate._sem), ctypes.byref(v))
    with open(f"{out}/hang_rank{rank}.txt", "w") as f:
        f.write(f"state {state} sem value {v.value} queue {jobs.qsize()}\n"); f.flush()
        r = subprocess.run(["gdb", "-p", str(os.getpid()), "-batch", "-ex", "thread apply all bt 25"], capture_output=True, text=True, timeout=60)
        f.write(r.stdout[-60000:]); f.write(r.stderr[-3000:])
    print(rank, "hang dumped", state, v.value, flush=True)
    os._exit(3)
threading.Thread(target=watchdog, daemon=True).start()
for loop in range(6):
    torch.cuda.synchronize(); dist.barrier()
    t0 = time.perf_counter()
    for _ in range(100): call()
    torch.cuda.synchronize()
    print(rank, f"loop {loop}: {1e3*(time.perf_counter()-t0)/100:.3f} ms per call", flush=True)
done.set()
print(rank, "no hang", state, flush=True)
dist.destroy_process_group()
