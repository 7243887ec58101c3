"""A collective's driver calls on its streams, collected and then made together.

A small CUDA collective queues about a dozen driver calls: copies (``cuMemcpyAsync``), 64-bit
flag writes and waits (``cuStreamWriteValue64`` / ``cuStreamWaitValue64``) and event waits
(``cuStreamWaitEvent``). ``StreamOps`` collects them, in order, and ``run`` makes them with the
device's primary context bound once around all of them, naming the call that failed. They go
through ctypes: on an H100 Python adds about 1 µs to a call the driver answers in 1.2–3 µs, and
making the calls from a compiled helper instead gained nothing per collective
(``benchmarks/results/comm_gpu/driver_calls/``).
"""

from __future__ import annotations

from freescale_comm.errors import FreescaleError

# The ``cuda._Driver`` entry point of each driver call, by the call's name.
_ENTRIES = {
    "cuMemcpyAsync": "memcpy_async",
    "cuStreamWriteValue64": "write_value64",
    "cuStreamWaitValue64": "wait_value64",
    "cuStreamWaitEvent": "stream_wait_event",
}


class StreamOps:
    """Driver calls collected for one ``run``, in the order they are made."""

    __slots__ = ("_calls",)

    def __init__(self) -> None:
        self._calls: list[tuple[str, tuple[int, ...]]] = []  # (call's name, its arguments)

    def __len__(self) -> int:
        return len(self._calls)

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        """``cuMemcpyAsync(dst, src, nbytes, stream)`` (unified addresses; none for 0 bytes)."""
        if nbytes:
            self._calls.append(("cuMemcpyAsync", (dst, src, nbytes, stream)))

    def write(self, stream: int, flag: int, value: int, flags: int = 0) -> None:
        """``cuStreamWriteValue64``: ``*flag = value`` once the stream's earlier work is done
        (flags 0: with a memory barrier, so earlier copies are visible first)."""
        self._calls.append(("cuStreamWriteValue64", (stream, flag, value, flags)))

    def wait(self, stream: int, flag: int, value: int, flags: int = 0) -> None:
        """``cuStreamWaitValue64``: the stream waits until the condition holds (flags 0:
        ``(int64)(*flag - value) >= 0``)."""
        self._calls.append(("cuStreamWaitValue64", (stream, flag, value, flags)))

    def wait_event(self, stream: int, event: int) -> None:
        """``cuStreamWaitEvent``: the stream waits for the work before the event's record (an
        event handle 0, never recorded, marks no work)."""
        if event:
            self._calls.append(("cuStreamWaitEvent", (stream, event, 0)))

    def run(self, device: int) -> None:
        """Makes the calls, in order, with ``device``'s primary context current (the thread's
        own context is restored), and forgets them.

        Raises:
            FreescaleError: a call failed (it is named; the calls before it were made, the
                ones after it were not).
        """
        queued, self._calls = self._calls, []
        if not queued:
            return
        from freescale_comm.cuda import driver  # (``cuda`` imports this module)

        cu = driver()
        replaced = cu.bind(device)
        try:
            for number, (name, args) in enumerate(queued, 1):
                code = getattr(cu, _ENTRIES[name])(*args)
                if code != 0:
                    raise FreescaleError(
                        f"CUDA driver call {name} (call {number} of {len(queued)} queued "
                        f"together) failed with CUresult {code}"
                    )
        finally:
            cu.restore(replaced)
