"""What one ``freescale train`` run trains, and how: a typed config per run."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

Dataset = Literal["synthetic", "ml-100k"]
DATASETS: tuple[str, ...] = ("synthetic", "ml-100k")
POLICIES: tuple[str, ...] = ("none", "fbs", "vbs", "kk")
MODES: tuple[str, ...] = ("sync", "prioritized", "auto")


@dataclass(frozen=True)
class RunConfig:
    """One training run (every rank runs the same).

    Attributes:
        name: the run's name (its folder under the output directory).
        backend: backend of the embedding and dense collectives (``gloo``, ``nccl``,
            ``freescale``); the pipeline's own exchanges use Gloo.
        policy: balancing policy, ``none`` for no balancer.
        mode: embedding mode, ``sync``, ``prioritized`` or ``auto`` (``auto_mode``: prioritized
            where every rank has a core to spare for its background thread, else sync; both
            train the same bits where balancing partitions alike, and the summary names the mode
            that ran and why).
    """

    name: str
    backend: str = "gloo"
    policy: str = "none"
    mode: str = "sync"


@dataclass(frozen=True)
class TrainConfig:
    """The data, the model and the schedule every run of one ``freescale train`` shares.

    Attributes:
        dataset: ``synthetic`` (heavy-tailed histories, the default) or ``ml-100k``.
        world_size: local ranks to start (ignored under torchrun).
        device: ``cpu`` or ``cuda`` (ranks share the GPUs round-robin).
        steps: global steps per run (``None``: one epoch).
        global_batch_size: samples per global step, split evenly over the ranks.
        max_history: longest history (synthetic data; ML-100K keeps the latest this many).
        num_users: users of the synthetic dataset.
        num_items: items of the synthetic dataset.
        num_negatives: sampled negatives per sample.
        embedding_dim: width of item embeddings and of the transformer.
        num_layers: transformer blocks.
        num_heads: attention heads.
        lr: dense Adam learning rate.
        embedding_lr: row-wise Adagrad learning rate of the item table.
        seed: seed of the data and of the initial weights.
        eval_users: users evaluated after training (``None``: all).
        checkpoint_dir: where each run saves at its end and resumes from when a checkpoint of
            that run is there (``None``: no checkpoints).
        threads: torch threads per rank.
        deterministic: ``torch.use_deterministic_algorithms`` in each rank (CUDA: atomics in
            embedding and attention backward otherwise make two identical runs differ).
        timeout_s: bound of every collective and wait.
        min_balance_gain: a balanced run keeps a batch where it was loaded when balancing
            would lower the slowest rank's predicted compute by less than this fraction
            (``BalancerConfig.min_gain``: the shuffle costs more than it saves).
        fit_cost_model: FBS and KK balance with a cost model fit online to the ranks'
            measured compute times (``BalancerConfig.fit``); ``False``: the FLOP model.

    Ranks that share their compute never balance (a GPU, or a host's cores where its ranks run
    more torch threads than it has: ``shared_cores``), since that compute does the same work
    however samples are split: a run with a policy then trains unbalanced, and its summary and
    table say why.
    """

    dataset: Dataset = "synthetic"
    world_size: int = 2
    device: str = "cpu"
    steps: int | None = 300
    global_batch_size: int = 32
    max_history: int = 256
    num_users: int = 8_192
    num_items: int = 4_096
    num_negatives: int = 32
    embedding_dim: int = 32
    num_layers: int = 1
    num_heads: int = 2
    lr: float = 1e-3
    embedding_lr: float = 0.05
    seed: int = 0
    eval_users: int | None = 1_024
    checkpoint_dir: str | None = None
    threads: int = 1
    deterministic: bool = False
    timeout_s: float = 300.0
    min_balance_gain: float = 0.05
    fit_cost_model: bool = True

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.global_batch_size % self.world_size:
            raise ValueError(
                f"the global batch ({self.global_batch_size}) must split evenly over "
                f"{self.world_size} ranks"
            )
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if not 0.0 <= self.min_balance_gain < 1.0:
            raise ValueError(f"min_balance_gain must be in [0, 1), got {self.min_balance_gain}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")

    def with_world_size(self, world_size: int) -> TrainConfig:
        return replace(self, world_size=world_size)


BASELINE = RunConfig("baseline", backend="gloo", policy="none", mode="sync")
FREESCALE = RunConfig("freescale", backend="freescale", policy="fbs", mode="auto")


def auto_mode(cores: int, local_ranks: int, threads: int) -> tuple[str, str]:
    """``mode="auto"`` on one host: prioritized where its ``cores`` leave every one of its
    ``local_ranks`` a core beside its ``threads`` torch threads, else sync. Prioritized mode
    moves the lookup, the updates and the prefetch to a background thread per rank; without a
    core of its own that thread takes the training thread's (on 2 cores, 2 ranks: FreeScale's
    step 14.4–14.7 ms prioritized, 12.8–13.8 sync, the baseline's 13.6–13.8). A heuristic: it
    counts neither the balancer's thread nor a backend's own threads, and only its sync side
    was measured at the threshold. Returns the mode and why."""
    needed = local_ranks * (threads + 1)
    why = f"{cores} cores, {local_ranks} local ranks, torch threads per rank: {threads}"
    if cores >= needed:
        return "prioritized", f"{why}; a spare core per rank for its background thread"
    return "sync", f"{why}; prioritized mode's background threads would need {needed} cores"


def shared_cores(cores: int, local_ranks: int, threads: int) -> str | None:
    """Why the ``local_ranks`` of one host share its ``cores``, or None where each rank's
    ``threads`` torch threads have cores of their own. Sharing, the cores run every rank's work
    in turn, so a sample moved from one rank to another leaves the step's compute as it was and
    adds the shuffle's. A heuristic, as ``auto_mode``: it counts only the torch threads."""
    if cores >= local_ranks * threads:
        return None
    each = f"{threads} torch thread{'s' if threads > 1 else ''} each"
    return (
        f"{local_ranks} local ranks of {each} share {cores} cores: balancing would move "
        "samples between ranks that run on the same cores"
    )


def check_run(run: RunConfig) -> None:
    """Raises ``ValueError`` for an unknown policy, mode or backend."""
    if run.policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {run.policy!r}")
    if run.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {run.mode!r}")
    if run.backend not in ("gloo", "nccl", "freescale"):
        raise ValueError(f"backend must be gloo, nccl or freescale, got {run.backend!r}")
