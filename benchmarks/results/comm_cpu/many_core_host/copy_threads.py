"""One host copy split over k threads: GB/s per size (median of 30), numpy's copy (GIL released).

python copy_threads.py
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def rate(size: int, threads: int, pool: ThreadPoolExecutor, repeats: int = 30) -> float:
    src = np.ones(size, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    parts = [(k * size // threads, (k + 1) * size // threads) for k in range(threads)]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        futures = [pool.submit(np.copyto, dst[a:b], src[a:b]) for a, b in parts[1:]]
        a, b = parts[0]
        np.copyto(dst[a:b], src[a:b])
        for future in futures:
            future.result()
        times.append(time.perf_counter() - start)
    return size / statistics.median(times) / 1e9


if __name__ == "__main__":
    with ThreadPoolExecutor(8) as pool:
        for mib in (1, 4, 16, 64):
            rates = " ".join(f"k={k}: {rate(mib << 20, k, pool):.1f} GB/s" for k in (1, 2, 4, 8))
            print(f"{mib} MiB {rates}", flush=True)
