"""Speed of the quantized matmul on SmolLM2's 4-bit shapes, through `Linear`.

Random Q4_1-style weights (4-bit codes, a scale and a zero per 32 inputs), attached with the
int8 path on for every step size; each shape is timed at a decode step's 64 rows and a
prefill step's 2048, best of 7, and printed as GOP/s (2 x M x K x N per call). Needs the
int8 kernel (AVX2).

    python benchmarks/quantized_matmul.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from pagellm.kernels import int8_matmul_available
from pagellm.model.quantized import Linear

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_quantized import random_weight  # noqa: E402

SHAPES = ((576, 3072), (1536, 576), (576, 960), (576, 576))  # (K, N): gate/up, down, qkv, o
ROWS = (1, 4, 16, 64, 2048)


def best_seconds(layer: Linear, x: torch.Tensor, repeats: int = 7) -> float:
    layer(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        layer(x)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    if not int8_matmul_available():
        sys.exit("the int8 matmul kernel is not built on this CPU (it needs AVX2)")
    for k, n in SHAPES:
        layer = Linear(k, n, bias=False)
        layer.attach_quantized(random_weight(4, n, k, True), 10**9, True)
        figures = []
        for m in ROWS:
            seconds = best_seconds(layer, torch.randn(m, k))
            figures.append(f"{m} rows: {seconds * 1e3:.3f} ms, {2 * m * k * n / seconds / 1e9:.0f} GOP/s")
        print(f"K={k} N={n}  " + " | ".join(figures))


if __name__ == "__main__":
    main()
