"""A collective's driver calls, made in one call from Python to C.

A small CUDA collective queues about a dozen driver calls: copies (``cuMemcpyAsync``), 64-bit flag
writes and waits (``cuStreamWriteValue64`` / ``cuStreamWaitValue64``) and event waits
(``cuStreamWaitEvent``). Each one made through ctypes costs 5–15 µs of Python around a call the
driver itself answers in about 1 µs, and the context has to be bound around them. ``StreamOps``
collects the calls as rows of integers; ``StreamOps.run`` hands them to ``fs_run``, a C function
that binds the device's primary context, makes every call in order, restores the thread's
context, and names the first call that failed.

The C source is below. The first CUDA collective of a process compiles it with the system's C
compiler (``$CC``, else ``cc`` or ``gcc``) into ``~/.cache/freescale-comm/``; it opens
``libcuda.so.1`` itself, so it needs no CUDA headers and no build step at install. Without a
compiler, or with ``FREESCALE_NATIVE_OPS=0``, the same calls go through ctypes one by one (a
warning is logged once).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from freescale_comm.errors import FreescaleError
from freescale_comm.options import NATIVE_OPS_ENV

logger = logging.getLogger(__name__)

# Row kinds, and the operands of each row: (kind, stream, a, b, c).
COPY = 0  # a: destination, b: source, c: bytes
WRITE = 1  # a: flag address, b: value, c: CUstreamWriteValue_flags
WAIT = 2  # a: flag address, b: value, c: CUstreamWaitValue_flags
WAIT_EVENT = 3  # a: CUevent
_ROW = 5
_NAMES = ("cuMemcpyAsync", "cuStreamWriteValue64", "cuStreamWaitValue64", "cuStreamWaitEvent")
_DRIVER_LIBRARY = "libcuda.so.1"
# The build runs in a collective's first call while the peers wait for this rank's header.
_BUILD_S = 20.0

_SOURCE = r"""
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>

typedef int (*init_f)(unsigned);
typedef int (*device_get_f)(int *, int);
typedef int (*retain_f)(void **, int);
typedef int (*get_current_f)(void **);
typedef int (*set_current_f)(void *);
typedef int (*memcpy_f)(uint64_t, uint64_t, size_t, void *);
typedef int (*value_f)(void *, uint64_t, uint64_t, unsigned);
typedef int (*wait_event_f)(void *, void *, unsigned);

static device_get_f device_get;
static retain_f retain;
static get_current_f get_current;
static set_current_f set_current;
static memcpy_f memcpy_async;
static value_f write_value;
static value_f wait_value;
static wait_event_f wait_event;

#define MAX_DEVICES 256
static void *contexts[MAX_DEVICES];

static void *entry(void *lib, const char *name, const char *v2) {
  void *found = dlsym(lib, v2);
  return found ? found : dlsym(lib, name);
}

static int loaded;

/* Opens the driver library (once: later calls change nothing); 0, or -1 with the call that
   failed named in *missing. */
int fs_load(const char *path, const char **missing) {
  if (loaded) return 0;
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  *missing = "dlopen";
  if (!lib) return -1;
#define ENTRY(var, type, name)                       \
  var = (type)entry(lib, name, name "_v2");          \
  if (!var) { *missing = name; return -1; }
  init_f init;
  ENTRY(init, init_f, "cuInit");
  ENTRY(device_get, device_get_f, "cuDeviceGet");
  ENTRY(retain, retain_f, "cuDevicePrimaryCtxRetain");
  ENTRY(get_current, get_current_f, "cuCtxGetCurrent");
  ENTRY(set_current, set_current_f, "cuCtxSetCurrent");
  ENTRY(memcpy_async, memcpy_f, "cuMemcpyAsync");
  ENTRY(write_value, value_f, "cuStreamWriteValue64");
  ENTRY(wait_value, value_f, "cuStreamWaitValue64");
  ENTRY(wait_event, wait_event_f, "cuStreamWaitEvent");
#undef ENTRY
  *missing = "cuInit";
  if (init(0) != 0) return -1;
  loaded = 1;
  return 0;
}

/* Makes the calls of `rows` (n rows of 5 words: kind, stream, a, b, c) in order with `device`'s
   primary context current, then restores the thread's context. Returns 0, or the first failing
   call's CUresult with its row in *failed (-1: binding the context failed). */
int fs_run(int device, const uint64_t *rows, int n, int *failed) {
  *failed = -1;
  if (device < 0 || device >= MAX_DEVICES) return 101; /* CUDA_ERROR_INVALID_DEVICE */
  void *context = __atomic_load_n(&contexts[device], __ATOMIC_ACQUIRE);
  int code;
  if (!context) {
    int handle;
    if ((code = device_get(&handle, device)) != 0) return code;
    if ((code = retain(&context, handle)) != 0) return code;
    void *expected = NULL; /* two threads may retain it: the primary context is one */
    __atomic_compare_exchange_n(&contexts[device], &expected, context, 0, __ATOMIC_ACQ_REL,
                                __ATOMIC_ACQUIRE);
  }
  void *current = NULL;
  if ((code = get_current(&current)) != 0) return code;
  if (current != context && (code = set_current(context)) != 0) return code;
  for (int i = 0; i < n && code == 0; i++) {
    const uint64_t *row = rows + 5 * (size_t)i;
    void *stream = (void *)(uintptr_t)row[1];
    switch (row[0]) {
      case 0: code = memcpy_async(row[2], row[3], (size_t)row[4], stream); break;
      case 1: code = write_value(stream, row[2], row[3], (unsigned)row[4]); break;
      case 2: code = wait_value(stream, row[2], row[3], (unsigned)row[4]); break;
      case 3: code = wait_event(stream, (void *)(uintptr_t)row[2], 0); break;
      default: code = 1; /* CUDA_ERROR_INVALID_VALUE */
    }
    if (code != 0) *failed = i;
  }
  if (current != context) {
    int restored = set_current(current);
    if (code == 0 && restored != 0) code = restored;
  }
  return code;
}
"""


class StreamOps:
    """Driver calls collected for one ``run``, in the order they are made."""

    __slots__ = ("_rows",)

    def __init__(self) -> None:
        self._rows: list[int] = []

    def __len__(self) -> int:
        return len(self._rows) // _ROW

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        """``cuMemcpyAsync(dst, src, nbytes, stream)`` (unified addresses; none for 0 bytes)."""
        if nbytes:
            self._rows += (COPY, stream, dst, src, nbytes)

    def write(self, stream: int, flag: int, value: int, flags: int = 0) -> None:
        """``cuStreamWriteValue64``: ``*flag = value`` once the stream's earlier work is done
        (flags 0: with a memory barrier, so earlier copies are visible first)."""
        self._rows += (WRITE, stream, flag, value, flags)

    def wait(self, stream: int, flag: int, value: int, flags: int = 0) -> None:
        """``cuStreamWaitValue64``: the stream waits until the condition holds (flags 0:
        ``(int64)(*flag - value) >= 0``)."""
        self._rows += (WAIT, stream, flag, value, flags)

    def wait_event(self, stream: int, event: int) -> None:
        """``cuStreamWaitEvent``: the stream waits for the work before the event's record (an
        event handle 0, never recorded, marks no work)."""
        if event:
            self._rows += (WAIT_EVENT, stream, event, 0, 0)

    def run(self, device: int) -> None:
        """Makes the calls, in order, with ``device``'s primary context current (the thread's
        own context is restored), and forgets them.

        Raises:
            FreescaleError: a call failed (it is named; the calls before it were made, the
                ones after it were not).
        """
        rows, self._rows = self._rows, []
        if not rows:
            return
        lib = native()
        if lib is None:
            _run_through_ctypes(device, rows)
            return
        failed = ctypes.c_int(-1)
        code = lib.fs_run(device, (ctypes.c_uint64 * len(rows))(*rows), len(rows) // _ROW, failed)
        if code != 0:
            raise FreescaleError(_failure(rows, failed.value, code))


def _failure(rows: list[int], failed: int, code: int) -> str:
    if failed < 0:
        return f"binding the primary context of the device failed with CUresult {code}"
    name = _NAMES[rows[failed * _ROW]] if rows[failed * _ROW] < len(_NAMES) else "unknown call"
    return (
        f"CUDA driver call {name} (call {failed + 1} of {len(rows) // _ROW} queued together) "
        f"failed with CUresult {code}"
    )


def _run_through_ctypes(device: int, rows: list[int]) -> None:
    """``StreamOps.run`` without the compiled function: the same calls through ctypes."""
    from freescale_comm.cuda import driver

    cu = driver()
    calls = (cu.memcpy_async, cu.write_value64, cu.wait_value64, cu.stream_wait_event)
    replaced = cu.bind(device)
    try:
        for index in range(0, len(rows), _ROW):
            kind, stream, a, b, c = rows[index : index + _ROW]
            handle = ctypes.c_void_p(stream)
            if kind == COPY:
                code = calls[kind](a, b, c, handle)
            elif kind == WAIT_EVENT:
                code = calls[kind](handle, ctypes.c_void_p(a), 0)
            else:
                code = calls[kind](handle, a, b, c)
            if code != 0:
                raise FreescaleError(_failure(rows, index // _ROW, code))
    finally:
        cu.restore(replaced)


_native: ctypes.CDLL | None = None
_settled = False
_settle_lock = threading.Lock()


def native(driver_library: str = _DRIVER_LIBRARY) -> ctypes.CDLL | None:
    """The compiled ``fs_run`` (built on first use), or None where it cannot be had (then
    ``run`` goes through ctypes). Settled once per process."""
    global _native, _settled
    if _settled:
        return _native
    with _settle_lock:
        if not _settled:
            if os.environ.get(NATIVE_OPS_ENV, "1") == "0":
                reason = f"{NATIVE_OPS_ENV}=0"
            else:
                try:
                    _native, reason = load(driver_library), ""
                except Exception as error:  # only a speed-up: never a reason to fail a call
                    reason = f"{type(error).__name__}: {error}"
            _settled = True
            if _native is None:
                logger.warning(
                    "freescale: a CUDA collective's driver calls go through ctypes one by one "
                    "(slower by 5-15 us each): %s",
                    reason,
                )
    return _native


def load(driver_library: str = _DRIVER_LIBRARY) -> ctypes.CDLL:
    """Builds (or finds built) the C source and loads it against ``driver_library`` (a path
    loaded once per process: loading it again keeps the driver library it has).

    Raises:
        FreescaleError: no compiler built it, or the driver library lacks a call it makes.
        OSError: the built library did not load, even built anew.
    """
    folder = _cache_folder()
    path = folder / _library_name()
    if not path.exists():
        with _build_lock(folder):  # the ranks of a host start together: one of them builds
            if not path.exists():
                _build(path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:  # a damaged file: built again
        with _build_lock(folder):
            _build(path)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:  # a folder mounted noexec: built apart
            with tempfile.TemporaryDirectory(prefix="freescale-comm-") as private:
                path = Path(private) / path.name
                _build(path)
                lib = ctypes.CDLL(str(path))  # stays mapped once its file is gone
    lib.fs_load.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]
    lib.fs_load.restype = ctypes.c_int
    lib.fs_run.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_int),
    ]
    lib.fs_run.restype = ctypes.c_int
    missing = ctypes.c_char_p()
    if lib.fs_load(driver_library.encode(), ctypes.byref(missing)) != 0:
        raise FreescaleError(
            f"the CUDA driver library {driver_library} did not load: "
            f"{missing.value.decode() if missing.value else 'unknown'} failed"
        )
    return lib


def _library_name() -> str:
    """The built helper's file name: one per source, machine and C library (a home folder may
    be shared by hosts of several systems)."""
    libc = "".join(platform.libc_ver()) or "libc"
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    return f"freescale_stream_ops_{platform.machine()}_{libc}_{digest}.so"


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on ``folder``'s lock file (released when its holder dies)."""
    with open(folder / "build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _cache_folder() -> Path:
    """``~/.cache/freescale-comm`` (``$XDG_CACHE_HOME`` honoured), or a private temporary
    folder of the process where that one is not this user's alone: a library loaded from a
    folder others may write to would run their code."""
    base = os.environ.get("XDG_CACHE_HOME") or (
        os.path.join(os.environ["HOME"], ".cache") if os.environ.get("HOME") else ""
    )
    if base:
        folder = Path(base) / "freescale-comm"
        try:
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            info = folder.stat()
            if info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return folder
        except OSError:
            pass
    private = Path(tempfile.mkdtemp(prefix="freescale-comm-"))
    atexit.register(shutil.rmtree, private, ignore_errors=True)
    return private


def _compilers() -> list[list[str]]:
    named = os.environ.get("CC")
    found = [shlex.split(named)] if named and shlex.split(named) else []
    return found + [[name] for name in ("cc", "gcc") if shutil.which(name)]


def _build(path: Path) -> None:
    """Compiles the C source into ``path`` (written under another name, then renamed into
    place, so a process never loads a half-written file), within ``_BUILD_S`` in all."""
    errors = []
    deadline = time.monotonic() + _BUILD_S
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        source = Path(work) / "stream_ops.c"
        source.write_text(_SOURCE)
        built = Path(work) / path.name
        for compiler in _compilers():
            command = [*compiler, "-O2", "-shared", "-fPIC", "-o", str(built), str(source), "-ldl"]
            left = deadline - time.monotonic()
            if left <= 0:
                errors.append(f"{compiler[0]}: not tried, {_BUILD_S:.0f} s spent")
                break
            try:
                result = subprocess.run(
                    command, capture_output=True, text=True, errors="replace", timeout=left
                )
            except (OSError, subprocess.SubprocessError) as error:
                errors.append(f"{compiler[0]}: {error}")
                continue
            if result.returncode == 0:
                os.replace(built, path)
                return
            errors.append(f"{compiler[0]}: {result.stderr.strip()[-300:]}")
    raise FreescaleError(
        "no C compiler built the driver-call helper ("
        + ("; ".join(errors) if errors else "none found: set CC")
        + ")"
    )
