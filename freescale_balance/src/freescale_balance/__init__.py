"""FreeScale sample load balancing: put each sample where the whole batch finishes soonest.

Pure partitioners (``partition``), a per-sample ``CostModel``, and the ``Balancer`` protocol that
gathers lengths, partitions and shuffles jagged batches over any process group, and undoes it.
"""

from freescale_balance.autotune import AlphaAutoTuneConfig, AlphaAutoTuner
from freescale_balance.balancer import (
    BalanceError,
    BalanceFuture,
    Balancer,
    BalancerConfig,
    ShufflePlan,
)
from freescale_balance.cost_fit import CostFitConfig, OnlineCostFit
from freescale_balance.cost_model import CostModel
from freescale_balance.jagged import JaggedBatch, JaggedBatchError, JaggedTensor
from freescale_balance.partition import (
    POLICIES,
    Partition,
    partition,
    partition_or_keep,
    straggler_fraction,
    vbs_weights,
)

__version__ = "0.1.0"

__all__ = [
    "POLICIES",
    "AlphaAutoTuneConfig",
    "AlphaAutoTuner",
    "BalanceError",
    "BalanceFuture",
    "Balancer",
    "BalancerConfig",
    "CostFitConfig",
    "CostModel",
    "JaggedBatch",
    "JaggedBatchError",
    "JaggedTensor",
    "OnlineCostFit",
    "Partition",
    "ShufflePlan",
    "partition",
    "partition_or_keep",
    "straggler_fraction",
    "vbs_weights",
]
