"""Whether this CPU's threads share their matmul and memory resources.

Prints a bf16 matmul's GFLOP/s and the memory read GB/s (benchmarks/memory_roof.py) on 2
threads, on 1, and with one thread doing each at the same time. If one of each side by
side gets what each gets alone on one thread, the threads are separate cores: running
decode attention (memory-bound) beside the matmuls (compute-bound) on the other core would
split both resources rather than overlap them.

    python benchmarks/cpu_sharing.py
"""

from __future__ import annotations

import threading
import time

import torch
from memory_roof import read_gbps

MATMUL = (1024, 2048, 2048)  # rows, inputs, outputs


def matmul_gflops(repeats: int = 20) -> float:
    m, k, n = MATMUL
    a, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    a @ w.T
    start = time.perf_counter()
    for _ in range(repeats):
        a @ w.T
    return 2 * m * k * n * repeats / (time.perf_counter() - start) / 1e9


def side_by_side() -> dict[str, float]:
    """One thread multiplying while another reads (torch on one thread each)."""
    results: dict[str, float] = {}
    workers = [threading.Thread(target=lambda: results.update(matmul=matmul_gflops(160))),
               threading.Thread(target=lambda: results.update(read=read_gbps(tries=20)))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return results


def main() -> None:
    for threads in (2, 1):
        torch.set_num_threads(threads)
        print(f"{threads} thread(s): matmul {matmul_gflops():.0f} GFLOP/s, "
              f"read {read_gbps():.1f} GB/s")
    both = side_by_side()
    print(f"side by side: matmul {both['matmul']:.0f} GFLOP/s, read {both['read']:.1f} GB/s")


if __name__ == "__main__":
    main()
