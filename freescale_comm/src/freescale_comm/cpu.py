"""How many cores this process may use: its affinity mask, capped by its cgroup's CPU quota.

A container with a CPU limit (``docker --cpus``, a Kubernetes limit) sees every core of the
machine in its affinity mask while the kernel lets it run only ``quota / period`` cores' worth
of time; ``idle_wait="auto"`` compares the ranks on a host with what they may use.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path


def usable_cores(root: str = "/") -> int:
    """The cores this process may run on: its affinity mask (where the OS has one), capped by
    the CPU quota of its cgroup or any cgroup above it (v1 or v2), rounded up.

    Args:
        root: the file-system root holding ``proc`` and ``sys`` (tests use a made-up tree).
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(root)
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


def cgroup_cpu_quota(root: str = "/") -> float | None:
    """The tightest CPU quota, in cores, of this process's cgroup and those above it (None:
    no quota, or no cgroup file system to read)."""
    base = Path(root)
    try:
        lines = (base / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2: one unified hierarchy
            limits += _walk(base / "sys/fs/cgroup", path, _v2_quota)
        elif "cpu" in controllers.split(","):
            limits += _walk(base / "sys/fs/cgroup" / controllers, path, _v1_quota)
    return min(limits, default=None)


def _walk(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """The quotas ``read`` finds from the cgroup at ``path`` up to the mount's root. Inside a
    container the mount's root is the container's own cgroup, whatever ``path`` says."""
    found = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        quota = read(mount.joinpath(*parts[:depth]))
        if quota is not None:
            found.append(quota)
    return found


def _v2_quota(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
