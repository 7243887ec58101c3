"""What the benchmark runs: phases, backends, time caps, targets, and NCCL 2.28.9's facts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


ROOT = Path(__file__).resolve().parents[2]


SRC_DIRS = [
    ROOT / name / "src"
    for name in ("freescale_comm", "freescale_balance", "freescale_embed", "kernels")
]


SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


OPS = ("all_gather_into_tensor", "all_to_all_single", "all_to_all_single_uneven")


OVERLAP_OPS = ("all_to_all_single", "all_gather_into_tensor")


FREESCALE = ("fs_ipc", "fs_direct", "fs_staged")


JSON_NAME = "multi_gpu_vs_nccl.json"


TARGET_PCT, TARGET_GAP = 2.0, 5.0


PHASES: list[dict[str, Any]] = [
    {
        "name": "main",
        "env": {"NCCL_CTA_POLICY": "2"},
        "backends": ["fs_ipc", "fs_direct", "fs_staged", "nccl", "nccl_ce"],
        "sections": ["setup", "correctness", "kernels", "sweep", "overlap"],
    },
    {
        "name": "nccl_p2p_memcpy",
        "env": {"NCCL_P2P_USE_CUDA_MEMCPY": "1"},
        "backends": ["nccl_p2p_memcpy"],
        "sections": ["setup", "kernels", "sweep", "overlap"],
    },
]


SECTION_CAP = {
    "setup": 90,
    "correctness": 90,
    "kernels": 60,
    "sweep": 170,
    "overlap": 160,
    "embed": 150,
}


SECTION_MIN = {"setup": 5, "correctness": 10, "kernels": 5, "sweep": 15, "overlap": 20, "embed": 15}


PHASE_MIN_S = 75  # a later phase starts only with this much budget left


NCCL_FACTS = {
    "version_read": "NVIDIA/nccl tag v2.28.9-1",
    "NCCL_CTA_POLICY": "env var (src/init.cc NCCL_PARAM CtaPolicy) overriding ncclConfig_t."
    "CTAPolicy: 0 default, 1 efficiency, 2 zero",
    "NCCL_CTA_POLICY_ZERO": "a constant of nccl.h (value 2), not an environment variable",
    "copy_engine_collectives": "AllGather, AlltoAll (ncclAlltoAll API), Gather, Scatter run as "
    "copy-engine collectives when CTAPolicy==ZERO, single node, "
    "comm->symmetricSupport (all CUDA P2P, cuMem, NCCL_WIN_ENABLE=1), "
    "send and recv buffers in NCCL_WIN_COLL_SYMMETRIC windows, driver "
    ">= 12.5 (src/enqueue.cc, src/ce_coll.cc)",
    "uneven_alltoall": "send/recv in 2.28.9: no copy-engine path",
    "policy_scope": "CTAPolicy is only consulted for windowed buffers (zero) and for the "
    "efficiency policy, so NCCL_CTA_POLICY=2 leaves collectives on plain "
    "cudaMalloc buffers on NCCL's default kernels",
    "NCCL_P2P_USE_CUDA_MEMCPY": "env var (src/transport/p2p.cc): P2P transport data moved by "
    "cudaMemcpy in the proxy thread (copy engines); kernels still "
    "run the protocol; process-wide, hence its own phase",
    "zero_sm_2_30": "NCCL 2.30's zero-SM AllGather/AlltoAll is not in 2.28.9",
}
