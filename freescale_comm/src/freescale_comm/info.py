"""``freescale comm info``: what this process really has — UCX transports, GPUs, links, NCCL."""

from __future__ import annotations

import os
import re
from typing import Any

from freescale_comm.options import EVERY_SIZE, READ_ABOVE_BYTES, FreescaleOptions
from freescale_comm.shm import host_identity, rings_supported
from freescale_comm.transport import Transport, ucx_version

_RESOURCE = re.compile(r"resource \d+\s*:\s*md \d+\s+dev \d+\s+flags \S*\s+(\S+)")


def ucx_transports() -> list[str]:
    """The UCX resources (``transport/device``) a context of this process opens.

    Read from UCX's own context description, so it reflects the UCX library actually loaded
    (the pip wheel or a system UCX) and ``UCX_TLS``; ``rc``/``ud``/``dc`` entries mean verbs
    (InfiniBand / RoCE) are usable, ``cuda_ipc`` means copy-engine transfers between GPUs.
    """
    transport = Transport.acquire()
    try:
        return _RESOURCE.findall(transport.context.info)
    finally:
        transport.release()


def gpu_info() -> list[dict[str, Any]]:
    """GPUs seen by NVML: name, memory, PCIe link (current / max), NVLink count. [] if none."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    gpus = []
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            entry: dict[str, Any] = {
                "index": index,
                "name": _text(pynvml.nvmlDeviceGetName(handle)),
                "memory_gib": round(pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30, 1),
                "pci_bus_id": _text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
            }
            for key, fn in (
                ("pcie_gen", pynvml.nvmlDeviceGetCurrPcieLinkGeneration),
                ("pcie_gen_max", pynvml.nvmlDeviceGetMaxPcieLinkGeneration),
                ("pcie_width", pynvml.nvmlDeviceGetCurrPcieLinkWidth),
                ("pcie_width_max", pynvml.nvmlDeviceGetMaxPcieLinkWidth),
            ):
                try:
                    entry[key] = int(fn(handle))
                except pynvml.NVMLError:
                    entry[key] = None
            links = 0
            for link in range(18):  # NVML_NVLINK_MAX_LINKS on Hopper
                try:
                    links += pynvml.nvmlDeviceGetNvLinkState(handle, link) == 1
                except pynvml.NVMLError:
                    break
            entry["nvlinks_active"] = links
            gpus.append(entry)
    finally:
        pynvml.nvmlShutdown()
    return gpus


_THP = "/sys/kernel/mm/transparent_hugepage"


def transparent_huge_pages(root: str = _THP) -> str:
    """The kernel's transparent huge page mode for 2 MiB pages: ``always``, ``madvise``,
    ``never`` or ``unknown`` (``page_rule`` says what it means for torch's tensors). Since
    Linux 6.8 the mode of each page size may override the global one, which it inherits
    unless set."""
    for path in (f"{root}/hugepages-2048kB/enabled", f"{root}/enabled"):
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            continue
        start, end = text.find("["), text.find("]")
        mode = text[start + 1 : end] if 0 <= start < end else "unknown"
        if mode != "inherit":
            return mode
    return "unknown"


def page_rule(torch_asks: bool, mode: str) -> str:
    """Which pages torch's CPU tensors of this environment get, given ``THP_MEM_ALLOC_ENABLE``
    (``torch_asks``) and the kernel's transparent huge page ``mode``. A peer's read of a large
    tensor pins a huge page in one step and a 4 KiB page per step."""
    if mode == "never":
        return "4 KiB pages (the kernel's transparent huge pages are off)"
    if mode == "always":
        return "huge pages wherever the kernel has them free (transparent huge pages: always)"
    if mode == "madvise" and torch_asks:
        return (
            "huge pages for the 2 MiB-aligned stretches of tensors of 2 MiB and more, where "
            "first touched after torch's advice (THP_MEM_ALLOC_ENABLE=1, kernel: madvise)"
        )
    if mode == "madvise":
        return (
            "4 KiB pages (kernel: madvise; with THP_MEM_ALLOC_ENABLE=1 torch asks for huge "
            "pages for tensors of 2 MiB and more, whose 2 MiB-aligned stretches a peer's read "
            "then pins with far less work)"
        )
    return "4 KiB pages unless the kernel has transparent huge pages (its mode is unknown)"


def torch_asks_for_huge_pages() -> bool:
    """Whether this process's torch advises huge pages for its CPU tensors of 2 MiB and more
    (``THP_MEM_ALLOC_ENABLE=1``)."""
    return os.environ.get("THP_MEM_ALLOC_ENABLE", "0") == "1"


def page_settings() -> dict[str, str]:
    """What decides the pages of local ranks' tensors, for a benchmark's report: the
    environment's ``THP_MEM_ALLOC_ENABLE`` (ranks inherit it) and the kernel's mode."""
    return {
        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", ""),
        "transparent_huge_pages": transparent_huge_pages(),
    }


def tensors_get_huge_pages(torch_asks: bool | None = None, mode: str | None = None) -> bool:
    """Whether torch's large CPU tensors in this process get transparent huge pages: the
    kernel gives them to every large mapping (``always``), or to those torch advises (its
    tensors of 2 MiB and more, ``THP_MEM_ALLOC_ENABLE=1``, under ``madvise``). Defaults: this
    process's environment and the kernel's mode."""
    if torch_asks is None:
        torch_asks = torch_asks_for_huge_pages()
    if mode is None:
        mode = transparent_huge_pages()
    return mode == "always" or (mode == "madvise" and torch_asks)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _paths_rank(ranks: int, hosts: int) -> list[dict[str, Any]]:
    """In a rank of the local launcher: its group's paths to every peer (``hosts`` > 0: this
    rank made to look as if on host ``rank * hosts // ranks``)."""
    from datetime import timedelta

    import torch.distributed as dist

    from freescale_comm._local_ranks import local_rank, store_port

    rank = local_rank()
    if hosts:
        os.environ["FREESCALE_HOST_ID"] = f"local-host-{rank * hosts // ranks}"
    store = dist.TCPStore("127.0.0.1", store_port(), is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "freescale", store=store, rank=rank, world_size=ranks, timeout=timedelta(seconds=60)
    )
    try:
        return dist.group.WORLD.paths()
    finally:
        dist.destroy_process_group()


def local_paths(ranks: int, hosts: int = 0, timeout_s: float = 120) -> list[dict[str, Any]]:
    """The path of every ordered pair of ``ranks`` local ranks (``hosts`` > 0: the ranks made
    to look as if spread over that many hosts, through ``FREESCALE_HOST_ID``); ``timeout_s``
    bounds the ranks' start and, again, their run."""
    from freescale_comm._local_ranks import GroupSpec, run_ranks

    spec = GroupSpec(ranks, backend=None, setup="freescale_comm:register", threads=None)
    reports = run_ranks(spec, _paths_rank, ranks, hosts, timeout_s=timeout_s)
    rows = [row for report in reports for row in report]
    return sorted(rows, key=lambda row: (row["rank"], row["peer"]))


def collect() -> dict[str, Any]:
    """Everything ``freescale comm info`` prints, as a dict."""
    import torch

    from freescale_comm import __version__

    info: dict[str, Any] = {
        "freescale_comm": __version__,
        "torch": torch.__version__,
        "ucx": ucx_version(),
        "ucx_transports": ucx_transports() if ucx_version() else [],
        "ucx_system_library": os.environ.get("RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY", "false"),
        "cuda_available": torch.cuda.is_available(),
        "nccl": None,
        "gpus": gpu_info(),
        "options": FreescaleOptions.from_env().__dict__,
        "host_identity": host_identity(),
        "rings": rings_supported() or "yes",
        "transparent_huge_pages": transparent_huge_pages(),
        "torch_huge_pages": torch_asks_for_huge_pages(),
    }
    if torch.cuda.is_available():
        version = torch.cuda.nccl.version()
        info["nccl"] = ".".join(str(v) for v in version) if isinstance(version, tuple) else version
    transports = {entry.split("/")[0] for entry in info["ucx_transports"]}
    info["rdma_verbs"] = bool(
        transports & {"rc", "rc_verbs", "rc_mlx5", "ud", "ud_verbs", "ud_mlx5", "dc_mlx5"}
    )
    info["cuda_ipc"] = "cuda_ipc" in transports
    return info


def format_info(info: dict[str, Any]) -> str:
    """Human-readable form of ``collect()``."""
    lines = [
        f"freescale-comm {info['freescale_comm']}  torch {info['torch']}",
        f"UCX {info['ucx'] or 'not installed (pip install freescale-comm[cu12] or [cu13])'}",
        f"  transports: {', '.join(info['ucx_transports']) or '-'}",
        f"  RDMA (verbs): {'yes' if info['rdma_verbs'] else 'no'}"
        + ("" if info["rdma_verbs"] else "  (the pip UCX has no verbs: see README, system UCX)"),
        f"  cuda_ipc: {'yes' if info['cuda_ipc'] else 'no'}",
        f"CUDA: {'yes' if info['cuda_available'] else 'no'}  NCCL: {info['nccl'] or '-'}",
    ]
    for gpu in info["gpus"]:
        lines.append(
            f"  GPU {gpu['index']}: {gpu['name']}, {gpu['memory_gib']} GiB, "
            f"bus {gpu['pci_bus_id']}, "
            f"PCIe gen {gpu['pcie_gen']}/{gpu['pcie_gen_max']} x{gpu['pcie_width']}/"
            f"{gpu['pcie_width_max']}, NVLinks active {gpu['nvlinks_active']}"
        )
    if not info["gpus"]:
        lines.append("  GPUs: none seen by NVML")
    opts = info["options"]
    lines.append(f"host identity: {info['host_identity']} (FREESCALE_HOST_ID overrides it)")
    if opts["host_path"] == "ucx":
        rule = "UCX for every peer (host_path=ucx)"
    elif info["rings"] != "yes":
        rule = f"UCX for every peer: no shared-memory rings here ({info['rings']})"
    elif opts["host_path"] == "shm":
        rule = "peers on this host: shared-memory rings (host_path=shm); other hosts: UCX"
    else:
        above = (
            "above that read by the receiver from the sender's memory, or UCX where the "
            "kernel refuses such reads"
            if opts["host_reads"]
            else "UCX above (host_reads=False)"
        )
        limit, by_pages = opts["shm_max_bytes"], ""
        if limit == -1:  # the group's choice (``GroupContext._ring_limit``), as this rank sees it
            huge = tensors_get_huge_pages(info["torch_huge_pages"], info["transparent_huge_pages"])
            # Else helpers and the probe decide, which are the group's (no probe without reads).
            limit = READ_ABOVE_BYTES if huge else (-1 if opts["host_reads"] else EVERY_SIZE)
            by_pages = (
                "; shm_max_bytes=-1: 512 KiB where every rank's torch CPU tensors get huge "
                "pages or every rank has read helpers (host_copy_threads), else the faster as "
                "measured between the host's ranks at set-up (--ranks N shows the group's "
                "choice)"
            )
        if limit >= EVERY_SIZE:
            rule = "peers on this host: shared-memory rings at every size"
        elif limit == -1:
            rule = (
                "peers on this host: shared-memory rings for messages <= 524288 B or of every "
                f"size; {above}"
            )
        else:
            rule = f"peers on this host: shared-memory rings for messages <= {limit} B, {above}"
        rule += (
            f"{by_pages}; host_path=auto: the faster path per size, "
            "benchmarks/comm_host_paths.py; other hosts: UCX"
        )
    lines.append(f"host bytes: {rule}")
    pages = page_rule(info["torch_huge_pages"], info["transparent_huge_pages"])
    if opts["host_reads"] and opts["host_huge_pages"]:
        pages += (
            "; a tensor that peers read and that a second collective sends again is moved "
            "onto 2 MiB pages once (host_huge_pages, Linux 6.1+)"
        )
    lines.append(f"torch CPU tensors: {pages}")
    for k, row in enumerate(info.get("paths", [])):  # sorted by rank: its first row
        if "waits" in row and (k == 0 or info["paths"][k - 1]["rank"] != row["rank"]):
            lines.append(f"  rank {row['rank']}, waiting for its peers: {row['waits']}")
        lines.append(f"  rank {row['rank']} -> {row['peer']}: {row['path']}  ({row['why']})")
        if "headers" in row:
            lines.append(f"    headers: {row['headers']}")
        if "cuda" in row:
            lines.append(f"    CUDA bytes: {row['cuda']}")
    options = ", ".join(f"{k}={v}" for k, v in info["options"].items())
    lines.append(f"options (FREESCALE_* applied): {options}")
    return "\n".join(lines)
