"""The prefetch thread's ordering hooks, checked for logic on CPU (CUDA runs them on streams)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import torch

from freescale_embed.streams import StreamOrder, _replaced, stream_order, tensors, to_device
from freescale_embed.worker import Worker


class _Recording(StreamOrder):
    """Logs each hook with the thread it ran on."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.tickets = 0

    def ticket(self) -> int:
        self.tickets += 1
        self.log.append(("ticket", threading.current_thread().name))
        return self.tickets

    def run(self, fn: Any, args: tuple[Any, ...], ticket: Any) -> tuple[Any, Any]:
        self.log.append(("run", ticket, threading.current_thread().name))
        return fn(*args), f"done {ticket}"

    def collect(self, result: Any, done: Any) -> None:
        self.log.append(("collect", result, done))

    def collect_failed(self) -> None:
        self.log.append(("collect_failed",))


def test_tasks_take_a_ticket_on_submit_and_are_collected_in_order():
    order = _Recording()
    worker = Worker(timedelta(seconds=10), order)
    first = worker.submit(lambda x: x + 1, 1)
    second = worker.submit(lambda x: x * 10, 5)
    assert worker.wait(second) == 50
    worker.close()
    caller = threading.current_thread().name
    assert [e for e in order.log if e[0] == "ticket"] == [("ticket", caller)] * 2
    runs = [entry for entry in order.log if entry[0] == "run"]
    assert [r[1] for r in runs] == [1, 2]
    assert all(r[2].startswith("freescale-embed-prefetch") for r in runs)
    # Waiting for the second task orders the caller after the first one too.
    assert [e for e in order.log if e[0] == "collect"] == [
        ("collect", 2, "done 1"),
        ("collect", 50, "done 2"),
    ]
    assert first.done()


def test_a_failed_task_is_ordered_before_the_callers_later_work():
    # Its table updates queued before it raised must not race the caller's reads.
    order = _Recording()
    worker = Worker(timedelta(seconds=10), order)

    def failing() -> None:
        raise ValueError("bad input")

    failed = worker.submit(failing)
    later = worker.submit(lambda: 7)
    with pytest.raises(ValueError, match="bad input"):
        worker.wait(later)
    assert worker.wait(later) == 7
    worker.close()
    assert [e[0] for e in order.log if e[0].startswith("collect")] == ["collect_failed", "collect"]
    assert failed.done()


@dataclass(frozen=True)
class _Inner:
    rows: list[torch.Tensor]
    count: int


@dataclass
class _Outer:
    inner: _Inner
    masks: dict[str, torch.Tensor]
    pair: tuple[torch.Tensor, str]


def test_every_tensor_of_a_task_is_found():
    a, b, c, d = (torch.zeros(i + 1) for i in range(4))
    found = list(tensors((_Outer(_Inner([a, b], 3), {"x": c}, (d, "name")), torch.nn.Linear(2, 2))))
    assert [t.numel() for t in found] == [1, 2, 3, 4]  # the module's parameters are not entered


def test_cpu_tables_need_no_stream_order():
    assert type(stream_order(torch.device("cpu"))) is StreamOrder


def _metadata() -> tuple[_Outer, torch.Tensor]:
    shared = torch.arange(3)
    outer = _Outer(
        _Inner([shared, torch.tensor([[1, 2], [3, 4]])], 3),
        {"x": torch.tensor([True, False]), "y": shared},
        (torch.tensor([0.5]), "name"),
    )
    return outer, shared


def test_replacing_tensors_keeps_the_structure_and_every_other_value():
    outer, shared = _metadata()
    moved = {id(t): t + 10 for t in tensors(outer)}
    rebuilt = _replaced(outer, moved)
    assert isinstance(rebuilt, _Outer) and isinstance(rebuilt.inner, _Inner)
    assert rebuilt.inner.count == 3 and rebuilt.pair[1] == "name"
    assert isinstance(rebuilt.pair, tuple) and isinstance(rebuilt.inner.rows, list)
    assert torch.equal(rebuilt.inner.rows[0], shared + 10)
    assert torch.equal(rebuilt.masks["y"], shared + 10)  # a tensor met twice, replaced twice
    assert torch.equal(rebuilt.inner.rows[1], torch.tensor([[11, 12], [13, 14]]))
    assert torch.equal(outer.inner.rows[0], shared)  # the original is left alone


def test_metadata_for_cpu_tables_stays_where_it_is():
    outer, _ = _metadata()
    assert to_device(outer, torch.device("cpu")) is outer


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_metadata_moves_to_cuda_with_its_values_dtypes_and_shapes():
    outer, _ = _metadata()
    moved = to_device(outer, torch.device("cuda"))
    pairs = list(zip(tensors(outer), tensors(moved), strict=True))
    assert len(pairs) == 5  # the shared tensor twice
    for host, device in pairs:
        assert device.is_cuda and device.dtype == host.dtype and device.shape == host.shape
        assert torch.equal(device.cpu(), host)
    assert moved.inner.count == 3 and moved.pair[1] == "name"
