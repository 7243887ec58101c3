"""Stream order between the training thread and the prefetch thread.

On CPU a task's result is ready when its function returns. On CUDA the prefetch thread queues its
kernels and copies on a side stream of its own, so that they overlap the training stream's dense
compute, and three things keep the result exactly that of one stream:

- a task starts on the GPU after everything the training stream had queued when it was
  submitted (the batch's IDs, the step's routing, its gradients): an event;
- the training stream uses a task's result only after the side stream has produced it: an
  event recorded at the end of the task, waited for where the training thread collects it;
- memory of a tensor used on both streams is not reused while the other stream may still read
  it: ``record_stream`` on every CUDA tensor of a task's arguments (for the side stream) and of
  its result (for the training stream), whichever thread drops the last reference.

Routing and collision plans are made on the host (IDs only: no GPU wait) and moved to the device
in one copy per dtype (``to_device``).

``torch.cuda`` is touched only when the collection's device is a CUDA device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch


def tensors(obj: object) -> Iterator[torch.Tensor]:
    """The tensors inside ``obj``: through dataclasses, mappings, lists and tuples.

    Modules are not entered: their tensors (the tables) live as long as the collection.
    """
    # Called on every prepared step on the training thread: the commonest cases first, and a
    # dataclass's attributes through ``vars`` (``dataclasses.fields`` costs twice as much).
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for item in obj:
            yield from tensors(item)
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from tensors(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for value in vars(obj).values():
            yield from tensors(value)


_T = TypeVar("_T")


def to_device(obj: _T, device: torch.device) -> _T:
    """``obj`` (host tensors inside dataclasses, mappings, lists and tuples) with its tensors on
    ``device``: one non-blocking copy per dtype from page-locked memory, so that the host never
    waits for the device's queued work (a copy from pageable memory would)."""
    if device.type == "cpu":
        return obj
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors(obj):
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    moved: dict[int, torch.Tensor] = {}
    for dtype, group in by_dtype.items():
        sizes = [t.numel() for t in group]
        staged = torch.empty(sum(sizes), dtype=dtype, pin_memory=True)
        torch.cat([t.reshape(-1) for t in group], out=staged)
        for tensor, copy in zip(
            group, staged.to(device, non_blocking=True).split(sizes), strict=True
        ):
            moved[id(tensor)] = copy.view(tensor.shape)
    return _replaced(obj, moved)


def _replaced(obj: Any, moved: Mapping[int, torch.Tensor]) -> Any:
    """``obj`` rebuilt with each tensor ``t`` replaced by ``moved[id(t)]`` (as ``tensors``
    walks it)."""
    if isinstance(obj, torch.Tensor):
        return moved[id(obj)]
    if isinstance(obj, list | tuple):
        return type(obj)(_replaced(item, moved) for item in obj)
    if isinstance(obj, Mapping):
        return {key: _replaced(value, moved) for key, value in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: _replaced(getattr(obj, f.name), moved)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return dataclasses.replace(obj, **changes)
    return obj


class StreamOrder:
    """How tasks of the prefetch thread are ordered with the training stream: on CPU, nothing."""

    def ticket(self) -> Any:
        """Taken on the training thread when a task is submitted (before the task runs)."""
        return None

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], ticket: Any) -> tuple[Any, Any]:
        """Runs ``fn(*args)`` on the prefetch thread; returns its result and a completion mark."""
        return fn(*args), None

    def collect(self, result: Any, done: Any) -> None:
        """Orders the caller's later work after the task that returned ``result``."""

    def collect_failed(self) -> None:
        """Orders the caller's later work after a task that raised (its work done so far, such
        as table updates it queued before raising)."""


class CudaStreamOrder(StreamOrder):
    """Tasks on one side stream of ``device``, ordered with the caller's current stream by events.

    Args:
        device: the CUDA device of the tables.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # High priority: the prefetch's small kernels and the host reads that follow them
        # (split sizes) would otherwise queue behind the blocks of the dense compute's long
        # kernels on the training stream, and the prefetch would finish after the dense part.
        self.stream = torch.cuda.Stream(device, priority=-1)

    def ticket(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def run(
        self, fn: Callable[..., Any], args: tuple[Any, ...], ticket: torch.cuda.Event
    ) -> tuple[Any, torch.cuda.Event]:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.wait_event(ticket)
            _record(args, self.stream)
            result = fn(*args)
            done = torch.cuda.Event()
            done.record(self.stream)
        return result, done

    def collect(self, result: Any, done: torch.cuda.Event) -> None:
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(done)
        _record(result, stream)

    def collect_failed(self) -> None:
        # The task has ended: everything it queued is on the side stream already.
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


def _record(obj: object, stream: torch.cuda.Stream) -> None:
    # Once per allocation: the stream is recorded for the memory block, which views share
    # (``to_device`` makes many views of one copy).
    recorded: set[int] = set()
    for tensor in tensors(obj):
        if tensor.is_cuda:
            block = tensor if tensor._base is None else tensor._base
            if id(block) not in recorded:
                recorded.add(id(block))
                block.record_stream(stream)


def stream_order(device: torch.device) -> StreamOrder:
    """The ordering the prefetch thread needs for tables on ``device``."""
    return CudaStreamOrder(device) if device.type == "cuda" else StreamOrder()
