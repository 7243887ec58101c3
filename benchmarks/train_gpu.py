"""``freescale train`` on the GPU machine, in one call: attention paths, exactness, step times.

1. The CUDA varlen attention path against the CPU PyTorch path (float32 reference), alone and
   inside SASRec's encoder with the same weights.
2. 2 ranks sharing the GPU over the freescale backend (NCCL cannot put two ranks on one GPU, so
   the baseline is freescale / no balancing / sync): baseline, balancing alone, prioritized
   alone, both; prioritized must train bitwise the weights of sync with the same balancing.
3. The CPU main job on this machine's quiet cores: 2 ranks with each technique alone, 4 ranks.

Usage: ``python3 benchmarks/train_gpu.py --out $OUT [--parts attention,cuda,cpu]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from freescale_embed.models.attention import (
    jagged_causal_attention_torch,
    jagged_causal_attention_varlen,
)
from freescale_embed.train import cli

CUDA_RUNS = (
    "freescale:none:sync,freescale:fbs:sync,freescale:none:prioritized,freescale:fbs:prioritized"
)
CUDA_MODEL = [
    "--device", "cuda", "--dim", "128", "--layers", "2", "--heads", "4", "--batch-size", "128",
    "--max-history", "2048", "--users", "16384", "--items", "100000", "--negatives", "128",
    "--eval-users", "2048", "--threads", "4",
]  # fmt: skip


def check_attention(out: Path) -> dict[str, float]:
    """Max |varlen (bf16, CUDA) - PyTorch (float32, CPU)| on random jagged inputs."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, 7, 64, 300, 1024, 33])
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    total, heads, dim = int(offsets[-1]), 4, 32
    q, k, v = (torch.randn(total, heads, dim, generator=generator) for _ in range(3))
    reference = jagged_causal_attention_torch(q, k, v, offsets, int(lengths.max()))
    cuda = [t.cuda() for t in (q, k, v)]
    varlen = jagged_causal_attention_varlen(*cuda, offsets.cuda(), int(lengths.max()))
    difference = (varlen.float().cpu() - reference).abs()
    result = {
        "max_abs_diff": float(difference.max()),
        "mean_abs_diff": float(difference.mean()),
        "reference_max_abs": float(reference.abs().max()),
        # bf16 keeps 8 bits of mantissa: inputs and output each round by up to 2^-9 relative.
        "bf16_bound": float(reference.abs().max()) * 2.0**-7,
    }
    result["within_bf16_rounding"] = result["max_abs_diff"] <= result["bf16_bound"]
    (out / "attention.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def _train(out: Path, argv: Sequence[str]) -> list[dict]:
    code = cli.main([*argv, "--out", str(out)])
    if code != 0:
        raise SystemExit(f"freescale train {' '.join(argv)} exited with {code}")
    return json.loads((out / "summary.json").read_text())


ABLATION = ",".join(
    [
        "baseline",
        "gloo:fbs:sync",
        "gloo:kk:sync",
        "gloo:none:prioritized",
        "freescale:none:sync",
        "gloo:fbs:prioritized",
        "freescale:fbs:prioritized",
    ]
)


def _exactness(out: Path, steps: int) -> list[str]:
    """Deterministic CUDA kernels, so that two runs can be compared bit for bit."""
    summaries = _train(
        out,
        [
            *CUDA_MODEL,
            "--deterministic",
            "--steps",
            str(steps),
            "--runs",
            f"{CUDA_RUNS},freescale:none:sync",
        ],
    )
    digests = [s["digest"] for s in summaries]
    names = [s["run"]["name"] for s in summaries]
    lines = [f"{n}: {d}" for n, d in zip(names, digests, strict=True)]
    lines.append(f"CUDA deterministic: sync twice bitwise equal: {digests[0] == digests[4]}")
    lines.append(f"CUDA: prioritized == sync bitwise (no balancing): {digests[0] == digests[2]}")
    lines.append(f"CUDA: prioritized == sync bitwise (FBS): {digests[1] == digests[3]}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="attention,exact,cuda,cpu")
    parser.add_argument("--cuda-steps", type=int, default=60)
    parser.add_argument("--cpu-steps", type=int, default=200)
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    lines = []
    started = time.time()
    if "attention" in parts:
        result = check_attention(args.out)
        lines.append(f"varlen attention vs CPU float32: {result}")
    if "exact" in parts:
        lines += _exactness(args.out / "cuda_exactness", args.cuda_steps)
    if "cuda" in parts:
        folder = args.out / "cuda_2ranks_one_gpu"
        _train(folder, [*CUDA_MODEL, "--steps", str(args.cuda_steps), "--runs", CUDA_RUNS])
        lines.append("CUDA, 2 ranks on one GPU:\n" + (folder / "table.txt").read_text())
    if "cpu" in parts:
        for world in (2, 4):
            folder = args.out / f"cpu_{world}ranks"
            runs = ABLATION if world == 2 else "baseline,freescale"
            _train(
                folder, ["--world-size", str(world), "--steps", str(args.cpu_steps), "--runs", runs]
            )
            lines.append(f"CPU, {world} ranks:\n" + (folder / "table.txt").read_text())
    lines.append(f"wall {time.time() - started:.0f} s")
    text = "\n".join(lines)
    (args.out / "summary.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
