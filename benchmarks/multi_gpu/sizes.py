"""Byte sizes (parsing, printing, the sweep's sizes) and each collective's element counts."""

from __future__ import annotations

from typing import Any

from .settings import GIB, KIB, MIB


def parse_size(text: str) -> int:
    """Bytes of ``8``, ``64K``, ``1MiB``, ``1G``..."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": KIB, "M": MIB, "G": GIB}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def fmt_size(nbytes: int) -> str:
    """``nbytes`` in the largest unit that divides it."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def sweep_sizes(lo: int, hi: int, factor: int) -> list[int]:
    """Sizes from ``lo`` to ``hi``, each ``factor`` times the previous."""
    sizes, size = [], max(1, lo)
    while size <= hi:
        sizes.append(size)
        size *= max(2, factor)
    return sizes


def uneven_counts(count: int, n: int) -> list[list[int]]:
    """Element counts c[src][dst], each row summing to ``count``; skewed, zeros for tiny counts."""
    rows = []
    for src in range(n):
        weights = [1 + (src + 2 * dst) % (n + 1) for dst in range(n)]
        row = [count * w // sum(weights) for w in weights]
        row[-1] += count - sum(row)
        rows.append(row)
    return rows


def geometry(op: str, nbytes: int, n: int, rank: int) -> tuple[int, int, int, Any]:
    """(elements of the nccl-tests "size", input numel, output numel, splits) of float32 data."""
    count = max(n, (nbytes // 4) // n * n)
    if op == "all_gather_into_tensor":
        return count, count // n, count, None
    if op == "all_to_all_single":
        return count, count, count, None
    c = uneven_counts(count, n)
    out_splits = [c[src][rank] for src in range(n)]
    return count, count, sum(out_splits), (out_splits, c[rank])
