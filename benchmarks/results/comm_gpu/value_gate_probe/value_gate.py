"""A small CUDA AllToAll through the host, the stream gated by a stream memory operation.

``torchrun --nproc-per-node 2 value_gate.py SWEEP`` on one GPU that both ranks share
(``SWEEP``: 1-5, the sweep of each run in this folder). Per size and route: whether 30
calls on changing inputs summed to the right result, the kernels of 3 calls (``pad_*``
routes), and the slower rank's medians of one call's host time, one call until
``torch.cuda.synchronize`` returns (``done``) and back-to-back calls (100, three times).

Routes:
- ``ipc``: the backend's IPC path (``cuda_path="ipc"``), as it is.
- ``freescale_host``: D2H into page-locked memory, the CPU waits for it, freescale's CPU
  AllToAll, H2D: the caller's CPU waits for its stream.
- ``value_event`` / ``value_flag``: the caller queues the D2H, a gate
  (``cuStreamWaitValue64`` on a page-locked flag) and the H2D behind it, and returns; a
  thread of the caller's waits for the D2H (its event, or a page-locked flag that the
  stream writes after it with ``cuStreamWriteValue64``, polled), runs the CPU AllToAll and
  writes the gate's flag. No validation before the call returns, and the output is written
  whatever the exchange did.
- ``pad_d2h`` / ``pad_both``: ``value_flag`` with the D2H (and the H2D) moving the whole
  64 KiB allocation the tensors are views of: which copy is slow when it is small.
- ``pad_scratch``: ``value_flag`` with the output kept on a failed exchange: the output's
  bytes D2H into a 64 KiB landing buffer before the gate (a failed verdict would leave them
  there), the thread copies the AllToAll's result into it, and behind the gate a 64 KiB
  H2D into a device scratch and an exact device-to-device copy into the output.
- ``pad_headers``: ``pad_scratch`` after an 8-byte AllToAll on the caller's thread (over a
  group of its own), standing in for the header round trip that a verdict before the call
  returns costs. ``pad_hdrbare``: that round trip, then ``value_flag`` (a verdict before
  the call returns needs no landing buffer: a bad one would queue no copy). ``pad_hdrlate``:
  the D2H and its flag queued first, then the round trip, then the gate and the H2D (the
  round trip overlaps the D2H).
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from freescale_comm import FreescaleOptions
from freescale_comm.cuda import driver

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/
from comm_gpu import _back_to_back, _max, _single_calls, _through_host

SWEEPS: dict[str, list[tuple[int, tuple[str, ...]]]] = {
    "1": [
        (size, ("ipc", "freescale_host", "value_event", "value_flag"))
        for size in (8, 64 << 10, 1 << 20)
    ],
    "2": [
        (64 << 10, ("ipc", "freescale_host", "value_flag", "pad_d2h")),
        (8, ("ipc", "freescale_host", "value_flag", "value_event", "pad_d2h", "pad_both")),
        (256, ("freescale_host", "value_flag")),
        (4 << 10, ("freescale_host", "value_flag", "pad_d2h")),
        (16 << 10, ("freescale_host", "value_flag")),
        (64 << 10, ("freescale_host", "value_flag", "value_event")),
        (8, ("freescale_host", "value_flag", "pad_d2h", "pad_both")),
        (1 << 20, ("value_flag",)),
    ],
    "3": [
        (size, ("ipc", "freescale_host", "value_flag", "pad_scratch", "pad_headers"))
        for size in (8, 4 << 10, 64 << 10, 8)
    ],
    "4": [(size, ("ipc", "value_flag", "pad_hdrbare")) for size in (8, 4 << 10, 64 << 10, 8)],
    "5": [
        (size, ("ipc", "value_flag", "pad_hdrbare", "pad_hdrlate"))
        for size in (8, 4 << 10, 64 << 10, 8)
    ],
}
PADDED_ELEMENTS = 16384  # 64 KiB of float32: the allocation every tensor here is a view of
TIMEOUT = timedelta(seconds=60)


class ValueGated:
    """One gated route on one pair of tensors (``route``: a name of the module docstring)."""

    def __init__(
        self, y: torch.Tensor, x: torch.Tensor, route: str, group: Any, header_group: Any
    ) -> None:
        self.cu = driver()
        self.group, self.header_group = group, header_group
        self.poll_flag = route != "value_event"
        self.scratch = route in ("pad_scratch", "pad_headers")
        self.headers_first = route in ("pad_headers", "pad_hdrbare")
        self.headers_late = route == "pad_hdrlate"
        padded_in = route in ("pad_d2h", "pad_both")
        self.x, self.y = x, y
        self.src_x = x._base if padded_in else x
        self.dst_y = y._base if route == "pad_both" else y
        self.host_x = torch.empty(self.src_x.shape, dtype=x.dtype, pin_memory=True)
        self.host_y = torch.empty(self.dst_y.shape, dtype=y.dtype, pin_memory=True)
        self.exchanged_in = self.host_x[: x.numel()]
        self.exchanged_out = self.host_y[: y.numel()]
        if self.scratch:
            self.landing = torch.empty(PADDED_ELEMENTS, dtype=y.dtype, pin_memory=True)
            self.device_scratch = torch.empty(PADDED_ELEMENTS, dtype=y.dtype, device=y.device)
        self.tiny_in, self.tiny_out = torch.zeros(2), torch.zeros(2)
        self.flags = torch.zeros(2, dtype=torch.int64, pin_memory=True)  # ready, go
        self.flag_values = self.flags.numpy()
        self.calls = 0
        self.marks: dict[int, dict[str, float]] = {}
        self.jobs: queue.SimpleQueue[tuple[int, torch.cuda.Event | None]] = queue.SimpleQueue()
        threading.Thread(target=self._exchange, daemon=True).start()

    def _exchange(self) -> None:
        while True:
            number, copied = self.jobs.get()
            if copied is not None:
                copied.synchronize()
            else:
                while self.flag_values[0] < number:
                    time.sleep(0)
            marks = self.marks.setdefault(number, {})
            marks["seen"] = time.perf_counter()
            dist.all_to_all_single(self.exchanged_out, self.exchanged_in, group=self.group)
            if self.scratch:
                self.landing[: self.y.numel()].copy_(self.exchanged_out)
            marks["opened"] = time.perf_counter()
            self.flag_values[1] = number

    def __call__(self) -> None:
        self.calls += 1
        number = self.calls
        cu = self.cu
        stream = torch.cuda.current_stream().cuda_stream
        ready, go = self.flags.data_ptr(), self.flags.data_ptr() + 8
        y_bytes = self.y.numel() * self.y.element_size()
        if self.headers_first:
            dist.all_to_all_single(self.tiny_out, self.tiny_in, group=self.header_group)
        if self.scratch:
            assert cu.memcpy_async(self.landing.data_ptr(), self.y.data_ptr(), y_bytes, stream) == 0
        self.host_x.copy_(self.src_x, non_blocking=True)
        copied = None
        if self.poll_flag:
            assert cu.write_value64(stream, ready, number, 0) == 0
        else:
            copied = torch.cuda.Event()
            copied.record()
        if self.headers_late:
            dist.all_to_all_single(self.tiny_out, self.tiny_in, group=self.header_group)
        assert cu.wait_value64(stream, go, number, 0) == 0
        if self.scratch:
            scratch, landing = self.device_scratch, self.landing
            padded = 4 * PADDED_ELEMENTS
            assert cu.memcpy_async(scratch.data_ptr(), landing.data_ptr(), padded, stream) == 0
            assert cu.memcpy_async(self.y.data_ptr(), scratch.data_ptr(), y_bytes, stream) == 0
        else:
            self.dst_y.copy_(self.host_y, non_blocking=True)
        self.jobs.put((number, copied))


def kernels_of(call: Callable[[], None], rank: int) -> int:
    """Kernels that 3 calls launch (memcpy and memset activities are not kernels)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            call()
        torch.cuda.synchronize()
    on_gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if rank == 0:
        print("profiled", sorted({e.name for e in on_gpu}), flush=True)
    copies = ("memcpy", "memset")
    return sum(1 for e in on_gpu if not any(word in e.name.lower() for word in copies))


def measure(route: str, nbytes: int, groups: dict[str, Any], rank: int) -> dict[str, Any]:
    """One row: correctness, kernels and the three times of ``route`` at ``nbytes``."""
    dev = torch.device("cuda", 0)
    gloo = groups["gloo"]
    numel = max(2, nbytes // 4)
    base_x = torch.ones(max(numel, PADDED_ELEMENTS), device=dev)
    base_y = torch.empty_like(base_x)
    x, y = base_x[:numel], base_y[:numel]
    if route == "ipc":
        call = lambda: dist.all_to_all_single(y, x, group=groups["ipc"])  # noqa: E731
    elif route == "freescale_host":
        call = _through_host(y, x, groups["ipc"])  # the caller's CPU waits for the D2H
    else:
        call = ValueGated(y, x, route, groups["ipc"], groups["header"])
    half = numel // 2
    total = torch.zeros_like(x)
    for k in range(30):  # each call on its own inputs, the results summed on the GPU
        x.fill_(rank * 1000 + k)
        call()
        total += y
    torch.cuda.synchronize()
    want = torch.empty_like(total)
    want[:half], want[half:] = sum(range(30)), 30 * 1000 + sum(range(30))
    correct = bool(torch.equal(total, want))
    kernels = kernels_of(call, rank) if route.startswith("pad") else None
    x.fill_(1.0)
    seen, opened = [], []

    def mark(start: float) -> None:
        if isinstance(call, ValueGated):
            marks = call.marks[call.calls]
            seen.append(marks["seen"] - start)
            opened.append(marks["opened"] - start)

    host, done = _single_calls(call, gloo, 40, mark)
    per_call = _back_to_back(call, gloo, 100)
    row: dict[str, Any] = {
        "path": route,
        "bytes": nbytes,
        "correct": correct,
        "kernels": kernels,
        "host_ms": 1e3 * _max(statistics.median(host), gloo),
        "done_ms": 1e3 * _max(statistics.median(done), gloo),
        "back_to_back_ms": 1e3 * _max(statistics.median(per_call), gloo),
    }
    if seen:
        row["ready_seen_ms"] = 1e3 * _max(statistics.median(seen), gloo)
        row["gate_opened_ms"] = 1e3 * _max(statistics.median(opened), gloo)
    return row


def main() -> None:
    sweep = SWEEPS[sys.argv[1]]
    dist.init_process_group("freescale")
    rank = dist.get_rank()
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    driver().bind(0)
    ipc = FreescaleOptions(cuda_path="ipc")
    groups = {
        "ipc": dist.new_group(backend="freescale", timeout=TIMEOUT, pg_options=ipc),
        "gloo": dist.new_group(backend="gloo", timeout=TIMEOUT),
        "header": dist.new_group(backend="freescale", timeout=TIMEOUT),
    }
    rows = []
    for nbytes, routes in sweep:
        for route in routes:
            rows.append(measure(route, nbytes, groups, rank))
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
    if rank == 0:
        with open(os.path.join(os.environ.get("OUT", "."), "value_gate.json"), "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
