"""FreeScale sequence embeddings: row-wise sharded tables, trained exactly, communication hidden.

``ShardedEmbeddingCollection`` shards tables row-wise over any process group and trains them
with a fused row-wise optimizer inside backward. In ``"prioritized"`` mode the rows of the next
step that the current step does not touch are prefetched in the background and only the
collision rows are synced on the critical path, with bitwise the same tables, optimizer state
and outputs as ``"sync"`` mode. ``TrainPipeline`` runs whole training steps of a model that
holds such collections: balancing, prefetch, DDP, outputs back to their ranks.
"""

from freescale_embed.collection import ShardedEmbeddingCollection
from freescale_embed.config import TableConfig
from freescale_embed.inputs import EmbeddingInputError
from freescale_embed.optim import SGD, Adam, Optimizer, RowWiseAdagrad
from freescale_embed.pipeline import PipelineConfig, PipelineError, StepOutput, TrainPipeline
from freescale_embed.pipeline_telemetry import StepReport
from freescale_embed.telemetry import StepTelemetry

__version__ = "0.1.0"

__all__ = [
    "SGD",
    "Adam",
    "EmbeddingInputError",
    "Optimizer",
    "PipelineConfig",
    "PipelineError",
    "RowWiseAdagrad",
    "ShardedEmbeddingCollection",
    "StepOutput",
    "StepReport",
    "StepTelemetry",
    "TableConfig",
    "TrainPipeline",
]
