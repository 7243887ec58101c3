"""``stream_ops``: a collective's driver calls, collected and then made together.

No GPU here: the calls go to a stand-in for ``libcuda.so.1`` compiled in the test, which records
each one (a unit test of ``StreamOps``'s own logic: order, arguments, the context bound and
restored, errors). The real driver runs under it in the CUDA tests on the GPU machine.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from freescale_comm import cuda
from freescale_comm.errors import FreescaleError
from freescale_comm.stream_ops import StreamOps

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

_RECORDING_DRIVER = r"""
#include <stdint.h>
#include <stdio.h>
#include <string.h>
static char log_text[1 << 16];
static void *current;
int fail_call = -1; /* the index of the stream call that fails, -1: none */
int fail_bind;
static int calls;
static void note(const char *line) {
  strncat(log_text, line, sizeof log_text - strlen(log_text) - 1);
}
const char *recorded(void) { return log_text; }
void forget(void) { log_text[0] = 0; calls = 0; current = 0; }
void make_current(uint64_t context) { current = (void *)(uintptr_t)context; }
static int stream_call(const char *line) {
  note(line);
  return calls++ == fail_call ? 700 : 0;
}
int cuInit(unsigned flags) { return 0; }
int cuDeviceGet(int *device, int ordinal) { *device = 100 + ordinal; return 0; }
int cuDevicePrimaryCtxRetain(void **context, int device) {
  *context = (void *)(uintptr_t)(0x1000 + device);
  return fail_bind ? 201 : 0;
}
int cuCtxGetCurrent(void **context) { *context = current; return 0; }
int cuCtxSetCurrent(void *context) {
  char line[64]; snprintf(line, sizeof line, "set %lx\n", (unsigned long)(uintptr_t)context);
  note(line); current = context; return 0;
}
int cuMemcpyAsync(uint64_t dst, uint64_t src, size_t n, void *stream) {
  char line[128];
  snprintf(line, sizeof line, "copy %lx %lx %lu on %lx\n", (unsigned long)dst, (unsigned long)src,
           (unsigned long)n, (unsigned long)(uintptr_t)stream);
  return stream_call(line);
}
int cuStreamWriteValue64_v2(void *stream, uint64_t flag, uint64_t value, unsigned flags) {
  char line[128];
  snprintf(line, sizeof line, "write %lx %lu %u on %lx\n", (unsigned long)flag,
           (unsigned long)value, flags, (unsigned long)(uintptr_t)stream);
  return stream_call(line);
}
int cuStreamWaitValue64_v2(void *stream, uint64_t flag, uint64_t value, unsigned flags) {
  char line[128];
  snprintf(line, sizeof line, "wait %lx %lu %u on %lx\n", (unsigned long)flag,
           (unsigned long)value, flags, (unsigned long)(uintptr_t)stream);
  return stream_call(line);
}
int cuStreamWaitEvent(void *stream, void *event, unsigned flags) {
  char line[128];
  snprintf(line, sizeof line, "event %lx on %lx\n", (unsigned long)(uintptr_t)event,
           (unsigned long)(uintptr_t)stream);
  return stream_call(line);
}
/* The rest of what cuda._Driver resolves: never called here. */
int cuStreamCreate(void) { return 1; }
int cuStreamDestroy_v2(void) { return 1; }
int cuDeviceGetAttribute(void) { return 1; }
int cuIpcGetMemHandle(void) { return 1; }
int cuIpcOpenMemHandle_v2(void) { return 1; }
int cuIpcCloseMemHandle(void) { return 1; }
int cuMemGetAddressRange_v2(void) { return 1; }
int cuMemAlloc_v2(void) { return 1; }
int cuMemFree_v2(void) { return 1; }
int cuMemHostGetDevicePointer_v2(void) { return 1; }
int cuDeviceGetUuid(void) { return 1; }
"""

# The calls every test queues: an event wait, a copy, a zero-byte copy (made by no one), a flag
# write and a flag wait, on two streams.
_EXPECTED = [
    "event 77 on a1",
    "copy 2000 1000 64 on a1",
    "write 3000 5 0 on a2",
    "wait 3008 4 0 on a2",
]


def _queue(ops: StreamOps) -> None:
    ops.wait_event(0xA1, 0x77)
    ops.wait_event(0xA1, 0)  # never recorded: no work to wait for
    ops.copy(0xA1, 0x2000, 0x1000, 64)
    ops.copy(0xA1, 0x2100, 0x1100, 0)
    ops.write(0xA2, 0x3000, 5)
    ops.wait(0xA2, 0x3008, 4)


class _Recorder:
    """The stand-in driver library, loaded with ctypes to read and steer it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.lib.recorded.restype = ctypes.c_char_p
        self.lib.make_current.argtypes = [ctypes.c_uint64]
        self._fail_call = ctypes.c_int.in_dll(self.lib, "fail_call")
        self._fail_bind = ctypes.c_int.in_dll(self.lib, "fail_bind")

    def lines(self) -> list[str]:
        return self.lib.recorded().decode().splitlines()

    def forget(self, current: int = 0, fail_call: int = -1, fail_bind: bool = False) -> None:
        self.lib.forget()
        self.lib.make_current(current)
        self._fail_call.value = fail_call
        self._fail_bind.value = int(fail_bind)


@pytest.fixture
def recorder(tmp_path: Path) -> _Recorder:
    source = tmp_path / "recording_driver.c"
    source.write_text(_RECORDING_DRIVER)
    path = tmp_path / "librecording_driver.so"
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(path), str(source)], check=True)
    return _Recorder(path)


@pytest.fixture
def recorded_driver(recorder: _Recorder, monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    """The stand-in, as the process's driver entry points."""
    monkeypatch.setattr(cuda, "_driver", cuda._Driver(str(recorder.path)))
    return recorder


def test_every_call_is_made_in_order_within_the_devices_context(
    recorded_driver: _Recorder,
) -> None:
    recorded_driver.forget(current=0x5)  # the thread's own context, restored afterwards
    ops = StreamOps()
    _queue(ops)
    assert len(ops) == 4
    ops.run(2)
    assert recorded_driver.lines() == ["set 1066", *_EXPECTED, "set 5"]
    assert len(ops) == 0  # forgotten once made
    recorded_driver.forget()
    ops.run(2)  # nothing queued: no call at all, not even a bind
    assert recorded_driver.lines() == []


def test_a_context_already_current_is_left_alone(recorded_driver: _Recorder) -> None:
    recorded_driver.forget(current=0x1065)  # device 1 (handle 101)'s primary context
    ops = StreamOps()
    _queue(ops)
    ops.run(1)
    assert recorded_driver.lines() == _EXPECTED


def test_a_failed_call_is_named_stops_the_rest_and_the_context_is_restored(
    recorded_driver: _Recorder,
) -> None:
    recorded_driver.forget(current=0x5, fail_call=2)
    ops = StreamOps()
    _queue(ops)
    with pytest.raises(FreescaleError, match=r"cuStreamWriteValue64 \(call 3 of 4 .*CUresult 700"):
        ops.run(3)
    assert recorded_driver.lines() == ["set 1067", *_EXPECTED[:3], "set 5"]
    assert len(ops) == 0  # the calls after it are dropped, not made by the next run


def test_a_context_that_cannot_be_had_is_reported_before_any_call(
    recorded_driver: _Recorder,
) -> None:
    recorded_driver.forget(fail_bind=True)
    ops = StreamOps()
    _queue(ops)
    with pytest.raises(FreescaleError, match=r"cuDevicePrimaryCtxRetain.*CUresult 201"):
        ops.run(7)
    assert recorded_driver.lines() == []
