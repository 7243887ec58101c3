"""The prefetch thread: runs tasks one at a time in submission order; errors reach the caller."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from datetime import timedelta
from typing import Any


class Worker:
    """One background thread running tasks in submission order; errors surface on the caller.

    Args:
        timeout: bound on every wait for a task.
    """

    def __init__(self, timeout: timedelta) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="freescale-embed-prefetch"
        )
        self._timeout = timeout.total_seconds()
        self._futures: list[concurrent.futures.Future] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future = self._executor.submit(fn, *args)
        self._futures.append(future)
        return future

    def wait(self, future: concurrent.futures.Future) -> Any:
        """The result of ``future``, after checking every task submitted before it succeeded."""
        while self._futures:
            head = self._futures[0]
            try:
                result = head.result(timeout=self._timeout)
            except concurrent.futures.TimeoutError:
                raise TimeoutError(
                    f"an embedding prefetch task did not finish within {self._timeout:.0f} s"
                ) from None
            self._futures.pop(0)
            if head is future:
                return result
        return future.result(timeout=self._timeout)

    def drain(self) -> None:
        """Waits for every submitted task (raising the first error)."""
        while self._futures:
            self.wait(self._futures[-1])

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._futures.clear()
