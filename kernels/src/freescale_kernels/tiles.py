"""Tile shapes of the Triton copy and segment-sum kernels: typed settings, passed in.

Every Triton operation takes ``tiles`` (default ``TUNED``); ``python -m freescale_kernels.tune``
times candidates by passing them in, and ``freescale kernels bench --copy-tile / --sum-tile``
measures one. Nothing rewrites a module's state. The interpreter (``TRITON_INTERPRET=1``) uses
its own few, large tiles whatever these say: it runs programs one after another in Python.

``TUNED`` holds the tiles chosen on one H200 with ``python -m freescale_kernels.tune``; the
sweep and its figures are in ``benchmarks/results/kernels/`` (``tune.json``, ``NOTES.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclass(frozen=True)
class CopyTile:
    """The tile of the jagged copy (``ops/jagged_copy.py``).

    Attributes:
        tile_bytes: bytes of words one program moves (rows = tile_bytes / row bytes).
        max_rows: bound on a tile's rows: the per-row search state costs registers.
        warps: warps per program.
        search_lanes: probes per round of the search for a tile's first and last run (0:
            binary search).
    """

    tile_bytes: int = 8192
    max_rows: int = 1024
    warps: int = 4
    search_lanes: int = 128

    def __post_init__(self) -> None:
        if self.tile_bytes < 1 or self.max_rows < 1:
            raise ValueError(f"tile_bytes and max_rows must be positive: {self}")
        if not _is_power_of_two(self.warps):
            raise ValueError(f"warps must be a power of two, got {self.warps}")
        if self.search_lanes and not _is_power_of_two(self.search_lanes):
            raise ValueError(f"search_lanes must be 0 or a power of two, got {self.search_lanes}")


@dataclass(frozen=True)
class SumTile:
    """The tile of ``segment_sum`` (``ops/dedup.py``).

    Attributes:
        elements: accumulator elements per program (segments x rows x columns).
        warps: warps per program.
    """

    elements: int = 2048
    warps: int = 4

    def __post_init__(self) -> None:
        if self.elements < 1 or not _is_power_of_two(self.warps):
            raise ValueError(f"elements must be positive and warps a power of two: {self}")


@dataclass(frozen=True)
class Tiles:
    """The tiles of every Triton operation."""

    copy: CopyTile = field(default_factory=CopyTile)
    segment_sum: SumTile = field(default_factory=SumTile)


TUNED = Tiles()
