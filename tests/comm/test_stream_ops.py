"""``stream_ops``: the compiled helper that makes a collective's driver calls in one call, its
ctypes fallback, and how it is built.

No GPU here: the helper runs against a stand-in for ``libcuda.so.1`` compiled in the test, which
records each call (a unit test of the helper's own logic: order, arguments, the context bound
and restored, errors). The real driver runs under it in the CUDA tests on the GPU machine.
"""

from __future__ import annotations

import ctypes
import logging
import shutil
import subprocess
from pathlib import Path

import pytest

from freescale_comm import cuda, stream_ops
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
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A cache folder of the test's own and a process that has not settled ``native`` yet."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.delenv("FREESCALE_NATIVE_OPS", raising=False)
    monkeypatch.setattr(stream_ops, "_native", None)
    monkeypatch.setattr(stream_ops, "_settled", False)
    return cache / "freescale-comm"


def _use_native(monkeypatch: pytest.MonkeyPatch, recorder: _Recorder) -> None:
    monkeypatch.setattr(stream_ops, "_native", stream_ops.load(str(recorder.path)))
    monkeypatch.setattr(stream_ops, "_settled", True)


def test_the_helper_makes_every_call_in_order_within_the_devices_context(
    fresh: Path, recorder: _Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    _use_native(monkeypatch, recorder)
    recorder.forget(current=0x5)  # the thread's own context, restored afterwards
    ops = StreamOps()
    _queue(ops)
    assert len(ops) == 4
    ops.run(2)
    assert recorder.lines() == ["set 1066", *_EXPECTED, "set 5"]
    assert len(ops) == 0  # forgotten once run
    recorder.forget()
    ops.run(2)  # nothing queued: no call at all
    assert recorder.lines() == []


def test_the_helper_leaves_a_context_already_current_alone(
    fresh: Path, recorder: _Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    _use_native(monkeypatch, recorder)
    recorder.forget(current=0x1065)  # device 1 (handle 101)'s primary context
    ops = StreamOps()
    _queue(ops)
    ops.run(1)
    assert recorder.lines() == _EXPECTED


def test_a_failed_call_is_named_and_stops_the_rest(
    fresh: Path, recorder: _Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    _use_native(monkeypatch, recorder)
    recorder.forget(current=0x5, fail_call=2)
    ops = StreamOps()
    _queue(ops)
    with pytest.raises(FreescaleError, match=r"cuStreamWriteValue64 \(call 3 of 4 .*CUresult 700"):
        ops.run(3)
    assert recorder.lines() == ["set 1067", *_EXPECTED[:3], "set 5"]


def test_a_context_that_cannot_be_had_is_reported(
    fresh: Path, recorder: _Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    _use_native(monkeypatch, recorder)
    recorder.forget(fail_bind=True)
    ops = StreamOps()
    _queue(ops)
    with pytest.raises(FreescaleError, match=r"primary context.*CUresult 201"):
        ops.run(7)
    assert recorder.lines() == []


def test_without_the_helper_ctypes_makes_the_same_calls(
    fresh: Path, recorder: _Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FREESCALE_NATIVE_OPS", "0")
    monkeypatch.setattr(cuda, "_driver", cuda._Driver(str(recorder.path)))
    recorder.forget(current=0x5)
    ops = StreamOps()
    _queue(ops)
    ops.run(2)
    assert recorder.lines() == ["set 1066", *_EXPECTED, "set 5"]
    recorder.forget(current=0x5, fail_call=1)
    _queue(ops)
    with pytest.raises(FreescaleError, match=r"cuMemcpyAsync \(call 2 of 4 .*CUresult 700"):
        ops.run(2)
    assert recorder.lines()[-1] == "set 5"  # restored after the failure too


def test_the_helper_is_built_once_and_found_in_the_cache(
    fresh: Path, recorder: _Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream_ops.load(str(recorder.path))
    built = list(fresh.glob("freescale_stream_ops_*.so"))
    assert len(built) == 1
    assert fresh.stat().st_mode & 0o077 == 0
    monkeypatch.setenv("CC", "false")  # a second load must not compile
    monkeypatch.setenv("PATH", "")
    stream_ops.load(str(recorder.path))
    assert list(fresh.glob("*.so")) == built


def test_a_cached_file_that_does_not_load_is_built_again(fresh: Path, recorder: _Recorder) -> None:
    fresh.mkdir(parents=True, mode=0o700)
    stale = fresh / stream_ops._library_name()
    stale.write_bytes(b"damaged")
    stream_ops.load(str(recorder.path))
    assert stale.read_bytes()[:4] == b"\x7fELF"


def test_a_cache_folder_it_cannot_load_from_gets_a_private_build(
    fresh: Path, recorder: _Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads = []
    real_cdll = ctypes.CDLL

    def cdll(path: str) -> ctypes.CDLL:  # as under a cache folder mounted noexec
        loads.append(Path(path))
        if Path(path).parent == fresh:
            raise OSError("failed to map segment from shared object")
        return real_cdll(path)

    monkeypatch.setattr(stream_ops.ctypes, "CDLL", cdll)
    stream_ops.load(str(recorder.path))
    assert [p.parent == fresh for p in loads] == [True, True, False]
    assert not loads[-1].exists()  # the private build is removed once loaded


def test_cc_with_options_is_used_and_a_failing_compiler_is_reported(
    fresh: Path, recorder: _Recorder, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen = tmp_path / "seen"
    wrapper = tmp_path / "mycc"
    wrapper.write_text(f'#!/bin/sh\necho "$@" > {seen}\nexec cc "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", f"{wrapper} -DCHOSEN=1")
    stream_ops.load(str(recorder.path))
    assert seen.read_text().startswith("-DCHOSEN=1 -O2 -shared")

    for built in fresh.glob("*.so"):
        built.unlink()
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("PATH", str(tmp_path))  # neither cc nor gcc to fall back on
    with pytest.raises(FreescaleError, match="no C compiler built the driver-call helper"):
        stream_ops.load(str(recorder.path))


def test_a_cache_folder_others_may_write_to_is_not_used(fresh: Path, recorder: _Recorder) -> None:
    fresh.mkdir(parents=True)
    fresh.chmod(0o777)
    stream_ops.load(str(recorder.path))
    assert list(fresh.glob("*.so")) == []  # built in a private temporary folder instead


def test_a_driver_library_without_the_calls_is_refused(fresh: Path, tmp_path: Path) -> None:
    with pytest.raises(FreescaleError, match="did not load: dlopen failed"):
        stream_ops.load(str(tmp_path / "no_such_library.so"))
    source = tmp_path / "partial.c"
    source.write_text(_RECORDING_DRIVER.replace("cuStreamWaitEvent", "cuStreamWaitEventNot"))
    partial = tmp_path / "libpartial.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(partial), str(source)], check=True)
    with pytest.raises(FreescaleError, match="did not load: cuStreamWaitEvent failed"):
        stream_ops.load(str(partial))


def test_native_ops_off_or_unavailable_falls_back_once_with_a_warning(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("FREESCALE_NATIVE_OPS", "0")
    with caplog.at_level(logging.WARNING, logger="freescale_comm.stream_ops"):
        assert stream_ops.native() is None
        assert stream_ops.native() is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "FREESCALE_NATIVE_OPS=0" in warnings[0]

    monkeypatch.delenv("FREESCALE_NATIVE_OPS")
    monkeypatch.setattr(stream_ops, "_settled", False)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="freescale_comm.stream_ops"):
        assert stream_ops.native("no_such_library.so") is None  # no driver on this machine
    assert "through ctypes" in caplog.records[0].getMessage()
