"""torchrun --nproc-per-node 2 (one shared GPU): a small CUDA AllToAll through the host where the
caller's CPU never waits for its stream, gated by stream memory operations instead of a host
function. Rows: ipc (today's path), freescale_host (the CPU waits for its D2H), value_event
(worker waits for the D2H's event; gate = cuStreamWaitValue64 on a pinned flag the worker
writes), value_flag (the stream writes a pinned ready flag after its D2H, the worker polls it).
A watchdog dumps gdb stacks if a loop stalls."""
import ctypes, json, os, queue, statistics, subprocess, sys, threading, time
from datetime import timedelta

import torch
import torch.distributed as dist

import freescale_comm  # noqa: F401
from freescale_comm import FreescaleOptions
from freescale_comm.cuda import driver

dist.init_process_group("freescale")
rank = dist.get_rank()
torch.cuda.set_device(0)
dev = torch.device("cuda", 0)
out = os.environ.get("OUT", "/tmp")
t = timedelta(seconds=60)
ipc = dist.new_group(backend="freescale", timeout=t, pg_options=FreescaleOptions(cuda_path="ipc"))
gloo = dist.new_group(backend="gloo", timeout=t)
cu = driver()
torch.zeros(1, device=dev)
cu.bind(0)
state = {"phase": "start"}
beat = [time.monotonic()]


def watchdog() -> None:
    while True:
        time.sleep(1)
        if time.monotonic() - beat[0] > 20:
            with open(f"{out}/stall_rank{rank}.txt", "w") as f:
                f.write(f"state {state}\n")
                f.flush()
                r = subprocess.run(
                    ["gdb", "-p", str(os.getpid()), "-batch", "-ex", "thread apply all bt 25"],
                    capture_output=True, text=True, timeout=60,
                )
                f.write(r.stdout[-80000:] + r.stderr[-3000:])
            print(rank, "stall dumped", state, flush=True)
            os._exit(3)


threading.Thread(target=watchdog, daemon=True).start()


def worst(v: float) -> float:
    x = torch.tensor([v], dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=gloo)
    return x.item()


def through_host(y, x):
    host_x = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host_y = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
    copied = torch.cuda.Event()

    def call():
        host_x.copy_(x, non_blocking=True)
        copied.record()
        copied.synchronize()
        dist.all_to_all_single(host_y, host_x, group=ipc)
        y.copy_(host_y, non_blocking=True)

    return call


def value_gated(y, x, poll_flag: bool):
    host_x = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host_y = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
    flags = torch.zeros(2, dtype=torch.int64, pin_memory=True)  # [ready, go]
    view = flags.numpy()
    ready_ptr, go_ptr = flags.data_ptr(), flags.data_ptr() + 8
    jobs = queue.SimpleQueue()
    count = [0]

    def exchange():
        while True:
            k, copied = jobs.get()
            if copied is not None:
                copied.synchronize()
            else:
                while view[0] < k:
                    time.sleep(0)
            dist.all_to_all_single(host_y, host_x, group=ipc)
            view[1] = k

    threading.Thread(target=exchange, daemon=True).start()

    def call():
        count[0] += 1
        k = count[0]
        stream = torch.cuda.current_stream().cuda_stream
        host_x.copy_(x, non_blocking=True)
        copied = None
        if poll_flag:
            assert cu.write_value64(stream, ready_ptr, k, 0) == 0
        else:
            copied = torch.cuda.Event()
            copied.record()
        assert cu.wait_value64(stream, go_ptr, k, 0) == 0
        y.copy_(host_y, non_blocking=True)
        jobs.put((k, copied))

    return call


rows = []
for nbytes in (8, 64 << 10, 1 << 20):
    numel = max(2, nbytes // 4)
    x = torch.ones(numel, device=dev)
    y = torch.empty_like(x)
    acc = torch.zeros_like(x)
    half = numel // 2
    for path in ("ipc", "freescale_host", "value_event", "value_flag"):
        state["phase"] = f"{path} {nbytes}"
        beat[0] = time.monotonic()
        if path == "ipc":
            call = lambda: dist.all_to_all_single(y, x, group=ipc)  # noqa: E731
        elif path == "freescale_host":
            call = through_host(y, x)
        else:
            call = value_gated(y, x, path == "value_flag")
        # Correctness: 30 calls, each on its own input, results summed on the GPU.
        acc.zero_()
        for k in range(30):
            x.fill_(rank * 1000 + k)
            call()
            acc += y
        torch.cuda.synchronize()
        want = torch.empty_like(acc)
        want[:half] = sum(range(30))
        want[half:] = 30 * 1000 + sum(range(30))
        ok = bool(torch.equal(acc, want))
        x.fill_(1.0)
        host, done = [], []
        for _ in range(40):
            dist.barrier(group=gloo)
            t0 = time.perf_counter()
            call()
            host.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            done.append(time.perf_counter() - t0)
        beat[0] = time.monotonic()
        per_call = []
        for _ in range(3):
            torch.cuda.synchronize()
            dist.barrier(group=gloo)
            t0 = time.perf_counter()
            for _ in range(100):
                call()
            torch.cuda.synchronize()
            per_call.append((time.perf_counter() - t0) / 100)
            beat[0] = time.monotonic()
        row = {
            "path": path,
            "bytes": nbytes,
            "correct": ok,
            "host_ms": 1e3 * worst(statistics.median(host)),
            "done_ms": 1e3 * worst(statistics.median(done)),
            "back_to_back_ms": 1e3 * worst(statistics.median(per_call)),
        }
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
if rank == 0:
    with open(f"{out}/value_gate.json", "w") as f:
        json.dump(rows, f, indent=1)
beat[0] = time.monotonic() + 1e6
dist.destroy_process_group()
