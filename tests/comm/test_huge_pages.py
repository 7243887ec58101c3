"""The policy of ``huge_pages.HugePages``: which send ranges it asks the kernel to collapse,
when, and how often (the system call replaced by a recorder; ``test_shm`` runs the real one
between real ranks)."""

from __future__ import annotations

import errno

from freescale_comm.huge_pages import (
    _ATTEMPTS,
    _REMEMBERED,
    HUGE_PAGE_BYTES,
    MADV_COLLAPSE,
    STEP_BYTES,
    HugePages,
)

MIB = 1 << 20


class Kernel:
    """Records each ``madvise`` and answers with the next of ``answers`` (then 0)."""

    def __init__(self, *answers: int) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.answers = list(answers)

    def __call__(self, address: int, nbytes: int, advice: int) -> int:
        self.calls.append((address, nbytes, advice))
        return self.answers.pop(0) if self.answers else 0


def test_a_range_is_collapsed_once_when_a_second_collective_sends_it():
    kernel = Kernel()
    pages = HugePages(kernel)
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
    pages = HugePages(kernel)
    for collective in range(4):
        pages.sending(HUGE_PAGE_BYTES + 4096, HUGE_PAGE_BYTES, collective)
    assert kernel.calls == []


def test_a_declined_collapse_is_retried_a_bounded_number_of_times():
    kernel = Kernel(*[errno.EAGAIN] * 10)  # pages pinned by a reader each time
    pages = HugePages(kernel)
    for collective in range(10):
        pages.sending(0, 8 * MIB, collective)
    assert len(kernel.calls) == _ATTEMPTS and pages.collapsed == 0


def test_an_invalid_range_is_not_retried_and_a_kernel_without_collapse_turns_it_off():
    kernel = Kernel(*[errno.EINVAL] * 10)
    pages = HugePages(kernel)
    for collective in range(3):
        pages.sending(0, 8 * MIB, collective)
    assert len(kernel.calls) == 1 and not pages.off
    for base in range(1, 4):  # three more ranges refused: nothing ever collapsed here
        for collective in range(2):
            pages.sending(base * 64 * MIB, 8 * MIB, collective)
    assert pages.off and len(kernel.calls) == 4
    pages.sending(512 * MIB, 8 * MIB, 0)
    pages.sending(512 * MIB, 8 * MIB, 1)
    assert len(kernel.calls) == 4


def test_ranges_are_remembered_up_to_a_bound():
    kernel = Kernel()
    pages = HugePages(kernel)
    for k in range(_REMEMBERED + 1):
        pages.sending(k * 8 * MIB, 8 * MIB, collective=0)
    last = _REMEMBERED * 8 * MIB
    pages.sending(last, 8 * MIB, collective=1)  # still remembered: its second
    assert kernel.calls == [(last, 8 * MIB, MADV_COLLAPSE)]
    pages.sending(0, 8 * MIB, collective=1)  # the least recent, forgotten: its first again
    assert len(kernel.calls) == 1


def test_a_large_range_is_collapsed_a_step_per_collective():
    kernel = Kernel(0, errno.EAGAIN, 0)
    pages = HugePages(kernel)
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
