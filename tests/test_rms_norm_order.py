"""RMSNorm's sum of squares in one written order, the same bits on every CPU: left to the
compiler's vectorizer it kept 8 partial sums in an AVX2 build and 16 in an AVX512 one, and
SmolLM2's answers differed between the two (the kernels' other checks: test_cpu_kernels.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.kernels import cpu_kernels_available

pytestmark = pytest.mark.skipif(not cpu_kernels_available(),
                                reason="no C++ compiler: the CPU kernels could not be built")


def norm_in_the_kernels_order(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float32 rows normalized with the sum of squares in rms_norm.cpp's order, whatever the
    CPU: 16 partial sums, element i fused-multiply-added into partial i % 16 up to the last
    whole 16, the rest into partial 0, then the partials added first to last. A float32
    square is exact in float64, so each fused multiply-add is its float64 sum rounded once
    more (not double rounding on these inputs: the test fails where it would be)."""
    rows = []
    for row in x.numpy():
        partial = np.zeros(16, dtype=np.float32)
        whole = len(row) // 16 * 16
        for start in range(0, whole, 16):
            v = row[start:start + 16].astype(np.float64)
            partial = (partial.astype(np.float64) + v * v).astype(np.float32)
        for value in row[whole:].astype(np.float64):
            partial[0] = np.float32(np.float64(partial[0]) + value * value)
        squares = np.float32(0)
        for p in partial:
            squares = np.float32(squares + p)
        inverse = np.float32(1) / np.sqrt(squares / np.float32(len(row)) + np.float32(eps))
        rows.append(row * inverse * weight.numpy())
    return torch.from_numpy(np.stack(rows))


@pytest.mark.parametrize("size", [576, 640, 37, 8])
def test_rms_norm_sums_its_squares_in_one_order_on_every_cpu(size: int) -> None:
    """The same bits with AVX2 as with AVX512: left to the compiler's vectorizer, the sum of
    squares took 8 partials on one and 16 on the other, and SmolLM2's answers differed."""
    weight = torch.randn(size, generator=torch.Generator().manual_seed(size))
    x = torch.randn(6, size, generator=torch.Generator().manual_seed(size + 1)) * 3
    residual = torch.randn(6, size, generator=torch.Generator().manual_seed(size + 2))
    alone = x.clone()
    torch.ops.pagellm.rms_norm(alone, weight, 1e-5)
    assert torch.equal(alone, norm_in_the_kernels_order(x, weight, 1e-5))
    fused, running = x.clone(), residual.clone()
    torch.ops.pagellm.add_rms_norm(fused, running, weight, 1e-5)
    assert torch.equal(running, x + residual)
    assert torch.equal(fused, norm_in_the_kernels_order(x + residual, weight, 1e-5))
