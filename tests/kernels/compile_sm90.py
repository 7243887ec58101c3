"""Compiles every Triton kernel for sm_90 (H200) down to a cubin, without a GPU.

Run as a script in a process without ``TRITON_INTERPRET`` (the interpreter replaces the kernels).
Integer arguments are specialised the way Triton's JIT does at launch (a value of 1 becomes a
constant unless the kernel says ``do_not_specialize``), because some code-generator failures
only show for those constants. Prints one line per failure and exits non-zero if any.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from freescale_kernels.ops import dedup, index_select, jagged_copy, ranged

TARGET = GPUTarget("cuda", 90, 32)
I64, I32 = "*i64", "*i32"


def compile_kernel(
    fn: Any,
    pointers: dict[str, str],
    ints: dict[str, int],
    constexprs: dict[str, Any],
    num_warps: int = 4,
) -> str | None:
    """None if ``fn`` compiles with these arguments, else the error."""
    fixed = {p.name for p in fn.params if p.do_not_specialize}
    signature: dict[str, str] = {}
    constants: dict[tuple[int, ...], Any] = {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name], constants[(i,)] = "constexpr", constexprs[name]
        elif name in pointers:
            signature[name] = pointers[name]
        elif ints[name] == 1 and name not in fixed:
            signature[name], constants[(i,)] = "constexpr", 1
        else:
            signature[name] = "i64" if abs(ints[name]) >= 2**31 else "i32"
    try:
        triton.compile(
            ASTSource(fn, signature, constants), target=TARGET, options={"num_warps": num_warps}
        )
    except Exception as exc:
        return f"{fn.__name__} {ints} {constexprs}: {exc!r}"[:3000]
    return None


def _ints(*names: str) -> Iterator[dict[str, int]]:
    for value in (1, 3, 2**33):
        yield dict.fromkeys(names, value)


def cases() -> Iterator[tuple[Any, dict[str, str], dict[str, int], dict[str, Any]]]:
    copy_ints = ("num_segments", "total_rows", "dim")
    for dtype, block_r, block_d in [(I64, 1024, 1), ("*i16", 32, 128), ("*fp32", 4, 256)]:
        for indirect, lanes in [(False, 0), (True, 0), (False, 128), (True, 128)]:
            for ints in _ints(*copy_ints):
                pointers = dict(
                    src=dtype, dst=dtype, out_offsets=I64, src_starts=I64, src_index=I64
                )
                flags = dict(INDIRECT=indirect, LANES=lanes, BLOCK_R=block_r, BLOCK_D=block_d)
                yield jagged_copy._gather_segments_kernel, pointers, ints, flags
    fused_pointers = dict.fromkeys(
        (
            "sorted_ranks",
            "order",
            "counts",
            "bounds",
            "out_offsets",
            "src_starts",
            "in_offsets",
            "positions",
            "key_splits",
            "rank_splits",
            "sample_counts",
        ),
        I64,
    )
    # Every direction at the largest block (registers) and, for one, the smallest and int64 sums.
    directions = [(1, 1, 1), (1, 0, 0), (0, 1, 0), (0, 0, 0)]
    variants = [(d, I64, 4096, tl.int32, I64) for d in directions]
    variants += [((1, 1, 1), I32, 1, tl.int32, "*u8"), ((1, 0, 0), I32, 64, tl.int64, I32)]
    variants += [((1, 1, 1), I64, 1024, tl.int32, "*i16")]
    for (has_order, to_rank_major, splits), lengths, block, offsets, ranks in variants:
        for ints in _ints("num_keys", "num_samples", "world_size"):
            if ints["num_keys"] > 2**31:
                continue  # the fused planner only takes a few keys and samples
            flags = dict(
                HAS_ORDER=bool(has_order),
                TO_RANK_MAJOR=bool(to_rank_major),
                SPLITS=bool(splits),
                SB=block,
                RB=1024,
                OFF=offsets,
            )
            pointers = dict(fused_pointers, lengths=lengths, out_lengths=lengths)
            pointers["sorted_ranks"] = ranks
            warps = min(max(block // 256, 4), 16)
            yield ranged._fused_plan_kernel, pointers, ints, flags, warps
    for ints in _ints("num_samples", "world_size"):
        yield ranged._rank_bounds_kernel, dict(sorted_ranks=I64, bounds=I64), ints, dict(BLOCK=1024)
    plan_pointers = dict(
        in_offsets=I64, order=I64, sorted_ranks=I64, bounds=I64, src_starts=I64, positions=I64
    )
    for lengths in (I32, I64):
        for has_ranks, has_bounds, has_order in [(1, 1, 1), (1, 0, 1), (0, 1, 0)]:
            for ints in _ints("num_keys", "num_samples", "world_size"):
                flags = dict(
                    HAS_ORDER=bool(has_order),
                    HAS_RANKS=bool(has_ranks),
                    HAS_BOUNDS=bool(has_bounds),
                    TO_RANK_MAJOR=bool(has_order),
                    BLOCK=1024,
                )
                pointers = dict(plan_pointers, in_lengths=lengths, out_lengths=lengths)
                yield ranged._rank_major_plan_kernel, pointers, ints, flags
    for ints in _ints("num_keys", "world_size"):
        pointers = dict.fromkeys(
            ("bounds", "out_offsets", "key_splits", "rank_splits", "sample_counts"), I64
        )
        yield ranged._splits_kernel, pointers, ints, dict(BLOCK=1024)
    for ints in _ints("num_samples", "num_selected", "num_keys"):
        pointers = dict(
            in_lengths=I32, in_offsets=I32, indices=I64, out_lengths=I32, src_starts=I64
        )
        yield index_select._select_plan_kernel, pointers, ints, dict(BLOCK=1024)
        pointers = dict(pointers, out_offsets=I64)
        for has_offsets in (False, True):
            flags = dict(HAS_OFFSETS=has_offsets, BLOCK=1024)
            yield index_select._fused_select_plan_kernel, pointers, ints, flags
    for dtype, f64 in [("*fp32", False), ("*bf16", False), ("*fp64", True)]:
        for ints in _ints("total_rows", "num_samples", "num_selected", "num_runs", "dim"):
            pointers = dict(
                grad_out=dtype,
                grad_in=dtype,
                in_offsets=I64,
                out_offsets=I64,
                picks=I64,
                pick_offsets=I64,
            )
            flags = dict(ACC_F64=f64, BLOCK_R=32, BLOCK_D=128)
            yield index_select._index_add_kernel, pointers, ints, flags
    for ints in _ints("n", "num_unique"):
        yield (
            dedup._run_starts_kernel,
            dict(sorted_ids=I64, starts=I64),
            {"n": ints["n"]},
            {"BLOCK": 1024},
        )
        pointers = dict.fromkeys(
            ("sorted_ids", "order", "starts", "run_ids", "unique", "inverse", "offsets"), I64
        )
        yield dedup._unique_scatter_kernel, pointers, ints, dict(BLOCK=1024)
    for dtype, acc in [("*fp32", tl.float32), ("*bf16", tl.float32), ("*i64", tl.int64)]:
        for has_order in (True, False):
            for segs, block_r in [(1, 32), (8, 4)]:
                for ints in _ints("num_segments", "dim"):
                    pointers = dict(values=dtype, out=dtype, offsets=I64, order=I64)
                    flags = dict(
                        HAS_ORDER=has_order, ACC=acc, SEGS=segs, BLOCK_R=block_r, BLOCK_D=128
                    )
                    yield dedup._segment_sum_kernel, pointers, ints, flags


def main() -> int:
    failures = [error for case in cases() if (error := compile_kernel(*case))]
    for error in failures:
        print("FAIL", error)
    print(f"sm_90 compile: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
