"""Each form of a bf16 projection against oneDNN's dense matmul, as a decode step reads them.

For each of SmolLM2's shapes, 30 layers of random Q4_1-style weights (the tied output head:
one Q8_0 layer), timed one pass over all of them after flushing their weights from the
caches (best of 5), in ms per pass:
- `tiles`: the codes widened to bf16 on AMX's bf16 tiles (quantized_linear_bf16_amx.cpp);
- `int8`: the codes times int8-rounded activations (the AMX int8 tiles, else AVX2);
- `int4`: torch's int4 kernel (4-bit codes, up to 8 rows);
- `float`: pagellm's kernel widening the codes to float32 (up to 16 rows);
- `dense`: the bf16 weights packed for oneDNN.
Needs a bf16 CPU; the tiles need AMX-BF16 (`PAGELLM_AMX=0` leaves them out).

    python benchmarks/quantized_forms.py [--rows 1 2 16 64 128 512 2048]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from pagellm.kernels import (bf16_tiles_available, quantized_linear_bf16_tiles,
                             quantized_linear_int8)
from pagellm.model.quantized import Linear, form_tensors
from pagellm.model.quantized_timing import best_seconds
from pagellm.model.torch_matmul import TORCH_INT4_MAX_TOKENS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_quantized import random_weight  # noqa: E402

# (K, N, bits, layers): qkv, o, gate/up, down, the output head
SHAPES = ((576, 960, 4, 30), (576, 576, 4, 30), (576, 3072, 4, 30), (1536, 576, 4, 30),
          (576, 49152, 8, 1))
FLOAT_MAX_ROWS = 16  # beyond, the float kernel is far behind every other form


def layers_of(k: int, n: int, bits: int, count: int) -> tuple[list[Linear], list[Linear]]:
    """The same weights twice: with the bf16 tiles (and the dense form), and with int8 panels."""
    tiled, int8 = [], []
    for _ in range(count):
        weight = random_weight(bits, n, k, with_zeros=bits == 4)
        layer = Linear(k, n, bias=False)
        layer.weight.data = weight.dequantize()
        layer = layer.to(torch.bfloat16)
        layer.attach_quantized(weight, 10**9, bf16_tiles=bf16_tiles_available())
        layer.pack_dense(shared=False)
        tiled.append(layer)
        twin = Linear(k, n, bias=False).to(torch.bfloat16)
        twin.attach_quantized(weight, 10**9, int8_activations=True)
        int8.append(twin)
    return tiled, int8


def time_forms(tiled: list[Linear], int8: list[Linear], m: int) -> dict[str, float]:
    x = torch.randn(m, tiled[0].in_features).bfloat16()
    n = tiled[0].out_features
    forms = {"dense": (lambda: [layer.dense_forward(x) for layer in tiled],
                       [t for layer in tiled for t in layer.tensors_read(m, quantized=False)])}
    if tiled[0].bf16_tiles is not None:
        forms["tiles"] = (lambda: [quantized_linear_bf16_tiles(x, t.codes, t.scales, t.zeros, n)
                                   for t in (layer.bf16_tiles for layer in tiled)],
                          [t for layer in tiled for t in form_tensors(layer.bf16_tiles)])
    if int8[0].int8_panels is not None:
        forms["int8"] = (lambda: [quantized_linear_int8(x, p.codes, p.scales, p.zeros, n)
                                  for p in (layer.int8_panels for layer in int8)],
                         [t for layer in int8 for t in form_tensors(layer.int8_panels)])
    if tiled[0].torch_int4 is not None and m <= TORCH_INT4_MAX_TOKENS:
        forms["int4"] = (lambda: [layer.torch_int4.matmul(x) for layer in tiled],
                         [t for layer in tiled for t in form_tensors(layer.torch_int4)])
    if m <= FLOAT_MAX_ROWS:
        forms["float"] = (lambda: [layer.float_kernel_forward(x) for layer in tiled],
                          [t for layer in tiled for t in form_tensors(layer.quantized)])
    return {name: best_seconds(run, tensors, tries=5) * 1e3
            for name, (run, tensors) in forms.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 16, 64, 128, 512, 2048])
    args = parser.parse_args()
    for k, n, bits, count in SHAPES:
        tiled, int8 = layers_of(k, n, bits, count)
        for m in args.rows:
            times = time_forms(tiled, int8, m)
            figures = "  ".join(f"{name} {ms:.2f}" for name, ms in sorted(times.items()))
            print(f"{k}x{n} Q{bits} x{count}, {m} rows: {figures}", flush=True)


if __name__ == "__main__":
    main()
