"""Speed of the int8 quantized matmul on SmolLM2's shapes, the kernel called directly.

Random weights prepared as the engine prepares them (`GroupQuantWeight.int8_panels`): Q4_1
style codes (4 bits, a scale and a zero per 32 inputs) for the layers' four projections,
Q8_0 style codes (8 bits, signed) for the head. Each shape is timed from a decode of one
request (1 row) to a prefill step's 2,048 rows, as the median of 5 batches of calls, and
printed as GOP/s (2 x M x K x N per call). Needs the int8 kernel (AVX2). With
`ATEN_CPU_CAPABILITY=avx2`, the AVX2 build on an AVX512 CPU (the same bits).

    python benchmarks/quantized_matmul.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from pagellm.kernels import int8_matmul_available

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_quantized import random_weight  # noqa: E402

# (K, N, bits): gate/up, down, qkv, o, the head
SHAPES = ((576, 3072, 4), (1536, 576, 4), (576, 960, 4), (576, 576, 4), (576, 49152, 8))
ROWS = (1, 4, 16, 64, 2048)


def seconds_per_call(x: torch.Tensor, panels, out_features: int) -> float:
    """Median over 5 batches of calls, each batch about 20 ms of work."""
    y = torch.empty(x.shape[0], out_features)
    call = torch.ops.pagellm.quantized_linear_int8
    call(y, x, panels.codes, panels.scales, panels.zeros)
    start = time.perf_counter()
    call(y, x, panels.codes, panels.scales, panels.zeros)
    calls = max(1, int(0.02 / max(time.perf_counter() - start, 1e-6)))
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            call(y, x, panels.codes, panels.scales, panels.zeros)
        batches.append((time.perf_counter() - start) / calls)
    return statistics.median(batches)


def main() -> None:
    if not int8_matmul_available():
        sys.exit("the int8 matmul kernel is not built on this CPU (it needs AVX2)")
    generator = torch.Generator().manual_seed(0)
    for k, n, bits in SHAPES:
        panels = random_weight(bits, n, k, bits == 4).int8_panels()
        figures = []
        for m in ROWS:
            seconds = seconds_per_call(torch.randn(m, k, generator=generator), panels, n)
            figures.append(f"{m} rows: {seconds * 1e3:.3f} ms, "
                           f"{2 * m * k * n / seconds / 1e9:.0f} GOP/s")
        print(f"K={k} N={n} {bits}-bit  " + " | ".join(figures), flush=True)


if __name__ == "__main__":
    main()
