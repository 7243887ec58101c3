"""Gradients: gradcheck through the references (float64), and Triton's backward against them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import freescale_kernels as fk
from tests.kernels.jagged_cases import DEVICE, Case, make_input

pytest.importorskip("triton")

SMALL = Case("small", num_keys=2, batch=5, world_size=3, dim=2, dtype=torch.float64, max_length=3)
REPEATS = torch.tensor([3, 0, 3, 1, 3, 4, 0])

Op = Callable[[torch.Tensor, str], torch.Tensor]


def ops(case: Case) -> dict[str, tuple[torch.Tensor, Op]]:
    """Differentiable operations on ``case``'s input, as ``values -> output values``."""
    values, lengths, ranks = make_input(case)
    world, keys = case.world_size, case.num_keys
    sent = fk.ranged_dispatch(values, lengths, ranks, world, backend="reference")
    counts = sent.sample_counts
    blocks = torch.tensor([2, 0, case.batch - 2], device=DEVICE)
    repeats = REPEATS.to(DEVICE) % max(case.batch, 1)
    offsets = torch.tensor([0, 2, 2, values.shape[0]], device=DEVICE)
    order = torch.randperm(values.shape[0], generator=torch.Generator().manual_seed(1))
    order = order.to(DEVICE)
    return {
        "jagged_index_select": (
            values,
            lambda v, b: fk.jagged_index_select(v, lengths, repeats, backend=b).values,
        ),
        "ranged_dispatch": (
            values,
            lambda v, b: fk.ranged_dispatch(v, lengths, ranks, world, backend=b).values,
        ),
        "ranged_combine": (
            sent.values,
            lambda v, b: fk.ranged_combine(v, sent.lengths, ranks, keys, backend=b).values,
        ),
        "keyed_transpose": (
            sent.values,
            lambda v, b: fk.keyed_transpose(v, sent.lengths, counts, keys, backend=b).values,
        ),
        "keyed_transpose_back": (
            values,
            lambda v, b: (
                fk.keyed_transpose(v, lengths, blocks, keys, to_key_major=False, backend=b).values
            ),
        ),
        "segment_sum": (values, lambda v, b: fk.segment_sum(v, offsets, backend=b)),
        "segment_sum_order": (
            values,
            lambda v, b: fk.segment_sum(v, offsets, order=order, backend=b),
        ),
    }


NAMES = list(ops(SMALL))


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_reference(name: str) -> None:
    values, op = ops(SMALL)[name]
    values = values.detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda v: op(v, "reference"), (values,))


@pytest.mark.parametrize("name", ["jagged_index_select", "ranged_dispatch", "segment_sum_order"])
def test_gradcheck_triton(name: str) -> None:
    values, op = ops(SMALL)[name]
    values = values.detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda v: op(v, "triton"), (values,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", NAMES)
def test_triton_gradients_match_reference(name: str, dtype: torch.dtype) -> None:
    case = Case("grads", num_keys=3, batch=11, world_size=5, dim=3, dtype=dtype, seed=4)
    values, op = ops(case)[name]
    grads = []
    for backend in ("triton", "reference"):
        leaf = values.detach().requires_grad_()
        out = op(leaf, backend)
        seed = torch.Generator().manual_seed(9)
        out.backward(torch.randn(out.shape, generator=seed).to(dtype).to(DEVICE))
        grads.append(leaf.grad)
    triton_grad, reference_grad = grads
    if name == "jagged_index_select" and dtype == torch.bfloat16:
        # Triton sums repeated picks in float32, the reference's index_add in bf16.
        torch.testing.assert_close(triton_grad, reference_grad, rtol=2e-2, atol=2e-2)
    elif name.startswith("segment_sum"):
        torch.testing.assert_close(triton_grad, reference_grad)
    else:
        assert torch.equal(triton_grad, reference_grad)
