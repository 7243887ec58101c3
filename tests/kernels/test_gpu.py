"""Compiled kernels on CUDA at realistic sizes (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

import freescale_kernels as fk
from freescale_kernels import bench

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("world_size", [8, 512])
@pytest.mark.parametrize("case", ["ids", "rows"])
def test_bench_inputs_match_reference(case: str, world_size: int) -> None:
    config = bench.BenchConfig(local_batch=512, max_length=4096, embedding_dim=64)
    values, lengths = bench.make_case(config, case)
    inputs = bench.make_inputs(config, values, lengths, world_size)
    for op in bench.OPS:
        if bench.ONLY_KIND.get(op, bench.case_kind(case)) != bench.case_kind(case):
            continue
        got = bench._call(op, inputs, "triton")()
        want = bench._call(op, inputs, "reference")()
        assert bench._same(got, want, op) is None, op


def test_segment_sum_is_bitwise_reproducible_on_cuda() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    values = torch.randn(200_000, 128, device="cuda", generator=gen)
    offsets = torch.sort(torch.randint(0, 200_001, (5000,), device="cuda", generator=gen)).values
    offsets = torch.cat([offsets.new_zeros(1), offsets, offsets.new_full((1,), 200_000)])
    first = fk.segment_sum(values, offsets)
    for _ in range(3):
        assert torch.equal(fk.segment_sum(values, offsets), first)


def test_gradients_on_cuda() -> None:
    lengths = torch.randint(0, 50, (2, 200), device="cuda")
    lengths[1, 7] = 20_000  # one huge sample
    values = torch.randn(int(lengths.sum()), 32, device="cuda")
    ranks = torch.randint(0, 64, (200,), device="cuda")
    grads = []
    for backend in ("triton", "reference"):
        leaf = values.detach().requires_grad_()
        out = fk.ranged_dispatch(leaf, lengths, ranks, 64, backend=backend).values
        out.backward(torch.ones_like(out).cumsum(0))
        grads.append(leaf.grad)
    assert torch.equal(*grads)
