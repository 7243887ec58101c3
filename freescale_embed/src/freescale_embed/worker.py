"""The prefetch thread: runs tasks one at a time in submission order; errors reach the caller."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from freescale_embed.streams import StreamOrder


class Worker:
    """One background thread running tasks in submission order; errors surface on the caller.

    Args:
        timeout: bound on every wait for a task.
        order: how tasks are ordered with the caller's GPU work (``streams.stream_order``).
    """

    def __init__(self, timeout: timedelta, order: StreamOrder) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="freescale-embed-prefetch"
        )
        self._timeout = timeout.total_seconds()
        self._order = order
        self._futures: list[concurrent.futures.Future] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Queues ``fn(*args)``; on a GPU it starts after the caller's work queued so far."""
        future = self._executor.submit(self._order.run, fn, args, self._order.ticket())
        self._futures.append(future)
        return future

    def wait(self, future: concurrent.futures.Future) -> Any:
        """The result of ``future``, after checking every task submitted before it succeeded.

        The caller's later GPU work is ordered after every task waited for.
        """
        while self._futures:
            head = self._futures[0]
            try:
                result, done = head.result(timeout=self._timeout)
            except concurrent.futures.TimeoutError:
                raise TimeoutError(
                    f"an embedding prefetch task did not finish within {self._timeout:.0f} s"
                ) from None
            except BaseException:
                # A failed task's error is raised once; the tasks after it still run. (A
                # KeyboardInterrupt here leaves a running task queued, to be waited for.)
                if head.done():
                    self._futures.pop(0)
                    self._order.collect_failed()
                raise
            self._futures.pop(0)
            self._order.collect(result, done)
            if head is future:
                return result
        result, done = future.result(timeout=self._timeout)
        return result

    def drain(self) -> None:
        """Waits for every submitted task (raising the first error)."""
        while self._futures:
            self.wait(self._futures[-1])

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._futures.clear()
