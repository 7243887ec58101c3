"""Fused row-wise optimizers: each step updates only the rows a batch touched, in place.

The update of a row depends only on that row's weight, state and aggregated gradient, and is
written with plain element-wise operations (no fused multiply-add kernels such as ``addcmul`` or
``add(alpha=...)``, whose vectorized body and scalar tail may round differently) and with
``row_sum``'s fixed-order reduction. So updating a set of rows in one call or split over several
calls gives the same bits, which is what lets prioritized mode update collision rows before the
others and still equal synchronous training.

Semantics follow FBGEMM's fused TBE optimizers (the ones TorchRec uses): SGD, exact row-wise
Adagrad (one accumulator per row, the mean of the squared gradient), and lazy Adam (moments of
untouched rows do not decay; bias correction uses the global step count).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freescale_embed._ops import row_sum


@dataclass(frozen=True)
class SGD:
    """Plain SGD: ``w -= lr * g``."""

    lr: float = 0.01

    def state_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        """Per-row shape of each state tensor this optimizer keeps (none)."""
        return {}

    def update(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        rows: torch.Tensor,
        grads: torch.Tensor,
        step: int,
    ) -> None:
        """Applies one step to ``weight[rows]`` given their aggregated ``grads``."""
        new = weight.index_select(0, rows) - grads * self.lr
        weight.index_copy_(0, rows, new)


@dataclass(frozen=True)
class RowWiseAdagrad:
    """Exact row-wise Adagrad (FBGEMM ``EXACT_ROWWISE_ADAGRAD``).

    ``m += mean(g**2)`` per row, then ``w -= lr * g / (sqrt(m) + eps)``.
    """

    lr: float = 0.01
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0

    def state_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        return {"momentum1": ()}

    def update(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        rows: torch.Tensor,
        grads: torch.Tensor,
        step: int,
    ) -> None:
        dim = grads.shape[1]
        accumulator = state["momentum1"]
        total = accumulator.index_select(0, rows) + row_sum(grads * grads) / dim
        accumulator.index_copy_(0, rows, total)
        denominator = total.sqrt() + self.eps
        scaled = grads / denominator[:, None]
        weight.index_copy_(0, rows, weight.index_select(0, rows) - scaled * self.lr)


@dataclass(frozen=True)
class Adam:
    """Lazy Adam (FBGEMM ``ADAM``): moments of a row change only in steps that touch it.

    Bias correction uses the collection's global step count.
    """

    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def state_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        return {"exp_avg": (dim,), "exp_avg_sq": (dim,)}

    def update(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        rows: torch.Tensor,
        grads: torch.Tensor,
        step: int,
    ) -> None:
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        first = exp_avg.index_select(0, rows) * self.beta1 + grads * (1.0 - self.beta1)
        second = exp_avg_sq.index_select(0, rows) * self.beta2 + (grads * grads) * (
            1.0 - self.beta2
        )
        exp_avg.index_copy_(0, rows, first)
        exp_avg_sq.index_copy_(0, rows, second)
        first_hat = first / (1.0 - self.beta1**step)
        second_hat = second / (1.0 - self.beta2**step)
        scaled = first_hat / (second_hat.sqrt() + self.eps)
        weight.index_copy_(0, rows, weight.index_select(0, rows) - scaled * self.lr)


Optimizer = SGD | RowWiseAdagrad | Adam


def initial_state(
    optimizer: Optimizer,
    rows: int,
    dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Fresh optimizer state for a shard of ``rows`` rows of width ``dim``."""
    fill = optimizer.initial_accumulator_value if isinstance(optimizer, RowWiseAdagrad) else 0.0
    return {
        name: torch.full((rows, *shape), fill, dtype=dtype, device=device)
        for name, shape in optimizer.state_shapes(dim).items()
    }
