"""Cross-memory attach (``cma``) against a real child process's memory."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from freescale_comm import cma
from freescale_comm.errors import FreescaleError

_CHILD = """
import sys, time
import numpy as np
data = np.arange(3 << 20, dtype=np.uint32).view(np.uint8)
print(data.ctypes.data, flush=True)
sys.stdin.read()
"""


@pytest.fixture
def child():
    """A process holding 12 MiB of known bytes; yields (pid, their address)."""
    process = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        address = int(process.stdout.readline())
        yield process.pid, address
    finally:
        process.kill()
        process.wait(timeout=10)


def test_reads_another_process_memory(child):
    pid, address = child
    want = np.arange(3 << 20, dtype=np.uint32).view(np.uint8)
    got = np.zeros(len(want), dtype=np.uint8)
    cma.read(pid, got, address)
    assert np.array_equal(got, want)
    # A piece from the middle, into the middle of a larger buffer.
    window = np.zeros(100, dtype=np.uint8)
    cma.read(pid, window[10:90], address + 4001)
    assert np.array_equal(window[10:90], want[4001:4081]) and not window[:10].any()
    assert cma.probe(pid, address + 8, want[8:16].tobytes()) is None
    assert "read back wrong" in cma.probe(pid, address + 8, b"12345678")


def test_a_bad_address_or_a_gone_process_is_an_error(child):
    pid, address = child
    with pytest.raises(FreescaleError, match="Bad address"):
        cma.read(pid, np.zeros(16, dtype=np.uint8), 8)
    process_gone = subprocess.Popen([sys.executable, "-c", "pass"])
    process_gone.wait(timeout=30)
    assert "No such process" in cma.probe(process_gone.pid, address, b"x")
