"""The host-function gate of ``../gated_host_route/`` back to back at 1 MiB, with its state
dumped if a loop stalls.

``torchrun --nproc-per-node 2 gate_hang.py`` on one GPU that both ranks share, with ae3afa3's
``benchmarks/comm_gpu.py`` and ``benchmarks/overlap_rounds.py`` in a folder on ``PYTHONPATH``
(``git show ae3afa3:benchmarks/comm_gpu.py > DIR/comm_gpu.py``, the same for the other; as
``device_call.sh`` does). ``comm_gpu`` holds
``_HostGate``, a ``cuLaunchHostFunc`` whose host function is libc's ``sem_wait``. The main
thread queues each call (D2H, event, gate, H2D) and hands it to a thread that waits for the
event, runs the AllToAll on host memory and opens the gate (``GATE_AHEAD=N``: the main
thread queues a call only while fewer than N gates are closed). 25 s without a finished loop:
each rank writes how many calls were queued, taken, exchanged and opened, and what the main
thread was doing, then tries ``gdb`` for native stacks (the GPU machine has no gdb).
"""

from __future__ import annotations

import ctypes
import os
import queue
import subprocess
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from comm_gpu import _HostGate

import freescale_comm  # noqa: F401  (registers the backend)

STALL_S = 25


def main() -> None:
    dist.init_process_group("freescale")
    rank = dist.get_rank()
    torch.cuda.set_device(0)
    out = os.environ.get("OUT", ".")
    nbytes = int(os.environ.get("GATE_BYTES", str(1 << 20)))
    ahead = int(os.environ.get("GATE_AHEAD", "0"))  # 0: the caller runs ahead unbounded
    x = torch.ones(nbytes // 4, device="cuda")
    y = torch.empty_like(x)
    host_x = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host_y = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
    jobs: queue.SimpleQueue[tuple[Any, _HostGate]] = queue.SimpleQueue()
    gate = _HostGate()
    state: dict[str, Any] = {"put": 0, "taken": 0, "exchanged": 0, "posted": 0, "phase": ""}

    def exchange() -> None:
        while True:
            copied, opens = jobs.get()
            state["taken"] += 1
            copied.synchronize()
            dist.all_to_all_single(host_y, host_x, group=dist.group.WORLD)
            state["exchanged"] += 1
            opens.open()
            state["posted"] += 1

    def call() -> None:
        while ahead and state["put"] - state["posted"] >= ahead:
            time.sleep(0)  # at most ``ahead`` gates closed at once
        stream = torch.cuda.current_stream()
        state["phase"] = "d2h"
        host_x.copy_(x, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(stream)
        state["phase"] = "gate"
        gate.close_on(stream.cuda_stream)
        state["phase"] = "h2d"
        y.copy_(host_y, non_blocking=True)
        jobs.put((copied, gate))
        state["put"] += 1
        state["phase"] = "put"

    done = threading.Event()

    def watchdog() -> None:
        if done.wait(STALL_S):
            return
        value = ctypes.c_int()
        ctypes.CDLL(None).sem_getvalue(ctypes.c_void_p(gate._sem), ctypes.byref(value))
        with open(f"{out}/hang_rank{rank}.txt", "w") as f:
            f.write(f"state {state} sem value {value.value} queue {jobs.qsize()}\n")
            f.flush()
            stacks = subprocess.run(
                ["gdb", "-p", str(os.getpid()), "-batch", "-ex", "thread apply all bt 25"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            f.write(stacks.stdout[-60000:] + stacks.stderr[-3000:])
        os._exit(3)

    threading.Thread(target=exchange, daemon=True).start()
    threading.Thread(target=watchdog, daemon=True).start()
    for loop in range(6):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(100):
            call()
        torch.cuda.synchronize()
        per_call = 1e3 * (time.perf_counter() - start) / 100
        print(rank, f"loop {loop}: {per_call:.3f} ms per call", flush=True)
    done.set()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
