"""A dense single-process reference of sharded embedding training, in float64.

It plays every rank's batches of a step against whole tables: outputs are rows, the gradient of
a row is the sum over all ranks' occurrences, and the optimizer formulas are written out again
here (independently of ``freescale_embed.optim``) and applied to the rows the step touched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from freescale_balance import JaggedBatch
from freescale_embed import SGD, Adam, Optimizer, RowWiseAdagrad, TableConfig


def loss_weights(rank: int, step: int, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """The fixed d(loss)/d(output) of each feature output (in output order) of a rank's step."""
    generator = torch.Generator().manual_seed(rank * 100_003 + step)
    return [torch.randn(shape, generator=generator) for shape in shapes]


class DenseReference:
    """Whole tables and optimizer state in float64, trained on the global batch of each step.

    Args:
        tables: the table configurations.
        initial: table name -> full initial rows (as ``state_dict(full=True)`` gives them).
        optimizer: the optimizer whose formulas to follow.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        initial: dict[str, torch.Tensor],
        optimizer: Optimizer,
    ) -> None:
        self.tables = list(tables)
        self.optimizer = optimizer
        self.weight = {t.name: initial[t.name].double().clone() for t in tables}
        self.state = {
            t.name: {
                "momentum1": torch.zeros(t.num_embeddings, dtype=torch.float64),
                "exp_avg": torch.zeros(t.num_embeddings, t.embedding_dim, dtype=torch.float64),
                "exp_avg_sq": torch.zeros(t.num_embeddings, t.embedding_dim, dtype=torch.float64),
            }
            for t in tables
        }
        self.steps = 0

    def outputs(self, batch: JaggedBatch) -> dict[str, torch.Tensor]:
        """Per feature, the rows of its IDs."""
        return {
            name: self.weight[t.name][batch.features[name].values.to(torch.int64)]
            for t in self.tables
            for name in t.feature_names
        }

    def step(
        self,
        batches: Sequence[JaggedBatch],
        grads_of: Callable[[int, list[torch.Size]], list[torch.Tensor]],
        lr: float,
    ) -> list[dict[str, torch.Tensor]]:
        """One training step over every rank's batch; returns each rank's outputs (before it).

        Args:
            batches: each rank's batch, in rank order.
            grads_of: ``(rank, output shapes) -> d(loss)/d(output)`` per feature output.
            lr: learning rate of this step.
        """
        self.steps += 1
        outputs = [self.outputs(batch) for batch in batches]
        totals = {t.name: torch.zeros_like(self.weight[t.name]) for t in self.tables}
        touched = {t.name: torch.zeros(t.num_embeddings, dtype=torch.bool) for t in self.tables}
        for rank, (batch, out) in enumerate(zip(batches, outputs, strict=True)):
            grads = grads_of(rank, [o.shape for o in out.values()])
            for (name, _), grad in zip(out.items(), grads, strict=True):
                table = next(t for t in self.tables if name in t.feature_names)
                ids = batch.features[name].values.to(torch.int64)
                totals[table.name].index_add_(0, ids, grad.double())
                touched[table.name][ids] = True
        for table in self.tables:
            rows = torch.nonzero(touched[table.name]).flatten()
            self._update(table.name, rows, totals[table.name][rows], lr)
        return outputs

    def _update(self, name: str, rows: torch.Tensor, g: torch.Tensor, lr: float) -> None:
        w, state, opt = self.weight[name], self.state[name], self.optimizer
        if isinstance(opt, SGD):
            w[rows] -= lr * g
        elif isinstance(opt, RowWiseAdagrad):
            state["momentum1"][rows] += (g * g).mean(1)
            w[rows] -= lr * g / (state["momentum1"][rows].sqrt() + opt.eps)[:, None]
        elif isinstance(opt, Adam):
            m = state["exp_avg"][rows] * opt.beta1 + (1 - opt.beta1) * g
            v = state["exp_avg_sq"][rows] * opt.beta2 + (1 - opt.beta2) * g * g
            state["exp_avg"][rows], state["exp_avg_sq"][rows] = m, v
            m_hat = m / (1 - opt.beta1**self.steps)
            v_hat = v / (1 - opt.beta2**self.steps)
            w[rows] -= lr * m_hat / (v_hat.sqrt() + opt.eps)
        else:
            raise AssertionError(type(opt))
