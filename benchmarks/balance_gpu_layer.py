"""Measured straggler % of none / FBS / VBS / KK on a real GPU layer, and the cost model fit.

One transformer-style layer (causal jagged flash attention + MLP, bf16, forward and backward)
runs over each simulated rank's assigned samples, one rank after another on the one GPU. The
per-rank times give the straggler fraction each policy really achieves, and all timings together
fit the cost model ``a*L^2 + b*L + c`` that FBS and KK balance.

    PYTHONPATH=freescale_balance/src python3 benchmarks/balance_gpu_layer.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from freescale_balance import (
    AlphaAutoTuner,
    CostModel,
    partition,
    straggler_fraction,
    vbs_weights,
)
from freescale_balance.simulate import LengthDistribution


class JaggedLayer(torch.nn.Module):
    """Pre-norm transformer block over concatenated variable-length sequences."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_length: int) -> torch.Tensor:
        tokens, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(tokens, 3, self.heads, width // self.heads).unbind(1)
        attended = torch.ops.aten._flash_attention_forward(
            q, k, v, offsets, offsets, max_length, max_length, 0.0, True, False
        )[0]
        x = x + self.proj(attended.reshape(tokens, width))
        return x + self.mlp(self.norm2(x))


def time_rank(layer: JaggedLayer, lengths: torch.Tensor, width: int, repeats: int) -> float:
    """Median ms of forward + backward of ``layer`` over one rank's samples."""
    if lengths.numel() == 0:
        return 0.0
    lengths = lengths.cuda()
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = torch.cumsum(lengths, 0)
    tokens = int(offsets[-1])
    max_length = int(lengths.max())
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    times = []
    for step in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        layer(x, offsets, max_length).float().square().mean().backward()
        end.record()
        end.synchronize()
        if step >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    layer = JaggedLayer(args.width, args.heads).cuda().to(torch.bfloat16)
    distribution = LengthDistribution()
    model = CostModel()
    points, groups, times = [], [], []
    for world in args.world_sizes:
        for max_uih in args.max_uih:
            rng = np.random.default_rng([world, max_uih])
            lengths = distribution.sample(max_uih, world * args.local_batch, rng)
            costs = model(lengths)
            tuner = AlphaAutoTuner()
            result = {"world_size": world, "max_uih": max_uih, "tokens": int(lengths.sum())}
            for policy in ("none", "fbs", "kk", "vbs"):
                # VBS tunes its exponent from the measured times of its own previous steps.
                for _ in range(args.vbs_steps if policy == "vbs" else 1):
                    weights = vbs_weights(lengths, tuner.alpha) if policy == "vbs" else costs
                    ranks = partition(weights, world, policy).ranks
                    rank_lengths = [lengths[ranks == r] for r in range(world)]
                    rank_ms = [time_rank(layer, g, args.width, args.repeats) for g in rank_lengths]
                    if policy == "vbs":
                        tuner.update(rank_lengths, torch.tensor(rank_ms).clamp_min(1e-3))
                groups += rank_lengths
                times += rank_ms
                result[policy] = {
                    "straggler_pct": 100 * straggler_fraction(torch.tensor(rank_ms)),
                    "predicted_straggler_pct": 100
                    * straggler_fraction(partition(weights, world, policy).loads(costs)),
                    "max_ms": max(rank_ms),
                    "mean_ms": statistics.mean(rank_ms),
                }
            result["vbs_alpha"] = tuner.alpha
            points.append(result)
            print(json.dumps(result), flush=True)
    fit = CostModel.fit_groups(groups, torch.tensor(times, dtype=torch.float64))
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "layer": {"width": args.width, "heads": args.heads, "dtype": "bfloat16", "pass": "fwd+bwd"},
        "local_batch": args.local_batch,
        "points": points,
        "cost_model_ms": {"a": fit.quadratic, "b": fit.linear, "c": fit.constant},
        "cost_model_median_rel_error": fit.relative_error(groups, torch.tensor(times)),
        "crossover_length": fit.linear / fit.quadratic if fit.quadratic > 0 else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--max-uih", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--local-batch", type=int, default=128)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vbs-steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("out/balance_gpu"))
    args = parser.parse_args()
    started = time.time()
    report = measure(args)
    report["wall_s"] = time.time() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "balance_gpu_layer.json").write_text(json.dumps(report, indent=2))
    policies = ("none", "fbs", "vbs", "kk")
    print(f"\n{'world':>5} {'maxUIH':>7} " + " ".join(f"{p:>14}" for p in policies))
    for point in report["points"]:
        cells = " ".join(
            f"{point[p]['straggler_pct']:6.2f}% ({point[p]['max_ms']:5.1f})"
            for p in ("none", "fbs", "vbs", "kk")
        )
        print(f"{point['world_size']:>5} {point['max_uih']:>7} {cells}")
    print("measured straggler % (slowest rank ms); cost model ms:", report["cost_model_ms"])
    print("median relative error of the fit:", report["cost_model_median_rel_error"])


if __name__ == "__main__":
    main()
