"""The policy of ``huge_pages.HugePages``: which send ranges it asks the kernel to collapse,
when, how often and on which thread (the system call replaced by a recorder; ``test_shm`` runs
the real one between real ranks)."""

from __future__ import annotations

import errno
import threading

from freescale_comm.engine import ENGINE_THREAD
from freescale_comm.huge_pages import (
    _ATTEMPTS,
    _REMEMBERED,
    HUGE_PAGE_BYTES,
    MADV_COLLAPSE,
    STEP_BYTES,
    HugePages,
    huge_pages,
)

MIB = 1 << 20


class Kernel:
    """Records each ``madvise`` (and its thread) and answers with the next of ``answers``."""

    def __init__(self, *answers: int) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.threads: list[str] = []
        self.answers = list(answers)

    def __call__(self, address: int, nbytes: int, advice: int) -> int:
        self.calls.append((address, nbytes, advice))
        self.threads.append(threading.current_thread().name)
        return self.answers.pop(0) if self.answers else 0


def test_a_range_is_collapsed_once_when_a_second_collective_sends_it():
    kernel = Kernel()
    pages = HugePages(kernel, supported=True)
    start = 64 * MIB + 4096  # not aligned: the whole 2 MiB pages inside it
    for _ in range(3):  # one collective sending it to three peers counts once
        pages.sending(start, 16 * MIB, collective=1)
    assert kernel.calls == []
    pages.sending(start, 16 * MIB, collective=2)
    assert kernel.calls == [(66 * MIB, 14 * MIB, MADV_COLLAPSE)]
    pages.sending(start, 16 * MIB, collective=3)
    assert len(kernel.calls) == 1 and pages.collapsed == 1


def test_a_range_without_a_whole_huge_page_is_left_alone():
    kernel = Kernel()
    pages = HugePages(kernel, supported=True)
    for collective in range(4):
        pages.sending(HUGE_PAGE_BYTES + 4096, HUGE_PAGE_BYTES, collective)
    assert kernel.calls == []


def test_a_declined_collapse_is_retried_a_bounded_number_of_times():
    kernel = Kernel(*[errno.EAGAIN] * 10)  # pages pinned by a reader each time
    pages = HugePages(kernel, supported=True)
    for collective in range(10):
        pages.sending(0, 8 * MIB, collective)
    assert len(kernel.calls) == _ATTEMPTS and pages.collapsed == 0
    assert pages.refusals == {"EAGAIN": _ATTEMPTS}


def test_a_range_refused_as_invalid_leaves_the_others_collapsing():
    kernel = Kernel(errno.EINVAL)  # a shared mapping that is not 2 MiB-aligned, say
    pages = HugePages(kernel, supported=True)
    for collective in range(3):
        pages.sending(0, 8 * MIB, collective)
    assert len(kernel.calls) == 1
    for collective in range(2):
        pages.sending(64 * MIB, 8 * MIB, collective)
    assert len(kernel.calls) == 2 and pages.collapsed == 1
    assert pages.refusals == {"EINVAL": 1}


def test_a_kernel_without_collapse_is_never_asked_twice():
    kernel = Kernel()
    pages = HugePages(kernel, supported=False)
    for collective in range(3):
        pages.sending(0, 8 * MIB, collective)
    assert kernel.calls == []


def test_this_kernel_is_asked_on_a_mapping_of_the_modules_own():
    # Whatever the answer (kernels before 6.1 refuse), asking leaves nothing behind.
    assert huge_pages.supported() in (True, False)


def test_ranges_are_remembered_up_to_a_bound():
    kernel = Kernel()
    pages = HugePages(kernel, supported=True)
    for k in range(_REMEMBERED + 1):
        pages.sending(k * 8 * MIB, 8 * MIB, collective=0)
    last = _REMEMBERED * 8 * MIB
    pages.sending(last, 8 * MIB, collective=1)  # still remembered: its second
    assert kernel.calls == [(last, 8 * MIB, MADV_COLLAPSE)]
    pages.sending(0, 8 * MIB, collective=1)  # the least recent, forgotten: its first again
    assert len(kernel.calls) == 1


def test_a_large_range_is_collapsed_a_step_per_collective():
    kernel = Kernel(0, errno.EAGAIN, 0)
    pages = HugePages(kernel, supported=True)
    size = 2 * STEP_BYTES + 6 * MIB
    for collective in range(6):
        pages.sending(0, size, collective)
    assert kernel.calls == [
        (0, STEP_BYTES, MADV_COLLAPSE),
        (STEP_BYTES, STEP_BYTES, MADV_COLLAPSE),  # declined: the same step again
        (STEP_BYTES, STEP_BYTES, MADV_COLLAPSE),
        (2 * STEP_BYTES, 6 * MIB, MADV_COLLAPSE),
    ]
    assert pages.collapsed == 1


def test_the_engine_thread_hands_the_collapse_to_a_thread_that_ends():
    kernel = Kernel()
    pages = HugePages(kernel, supported=True)

    def engine() -> None:
        pages.sending(0, 8 * MIB, collective=0)
        pages.sending(0, 8 * MIB, collective=1)

    thread = threading.Thread(target=engine, name=ENGINE_THREAD)
    thread.start()
    thread.join(10)
    worker = pages._worker
    if worker is not None:
        worker.join(10)
    assert kernel.calls == [(0, 8 * MIB, MADV_COLLAPSE)]
    assert kernel.threads == ["freescale-comm-huge-pages"]
    assert pages._worker is None and pages.collapsed == 1
