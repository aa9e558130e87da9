"""Start-up timings that decide which form of a quantized projection (quantized.py) each
step size multiplies: whether the int8 path beats the dense matmul before the float weights
load, where torch's int4 kernel serves small steps, and up to which step size the quantized
form beats the dense one, per shape. Each timing first flushes the weights it reads from
the caches: a decode step over the whole model reads them from memory.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

from pagellm.kernels import evict_from_cache
from pagellm.model.quantized import (ANY_TOKENS, CODE_BLOCK, INT8_MIN_TOKENS, Linear,
                                     QuantizedForm, form_tensors)
from pagellm.model.torch_matmul import packed_weights_supported

# Up to the default budget of a prefill step: the bf16 tiles beat oneDNN up to a few hundred
# tokens and lose past that.
CANDIDATE_MAX_TOKENS = (1, 2, 4, 8, INT8_MIN_TOKENS, 16, 32, 64, 128, 512, 1024, 2048)
# Layers of a shape timed together, times tokens: all of SmolLM2's 30 layers up to 64
# tokens, fewer beyond (one at 2048), where compute rather than reading weights bounds a step.
MEASURED_LAYER_TOKENS = 2048
# The step size at which the int8 path is compared with a dense matmul before the float
# weights load: compute-bound, where a dense matmul does best against quantized codes.
PROBE_TOKENS = 512
# The step sizes at which torch's int4 kernel is timed against pagellm's.
INT4_CANDIDATE_TOKENS = (1, 2, 4, 8)


def int8_beats_dense(layers: Sequence[Linear], dtype: torch.dtype) -> list[Linear]:
    """The layers (with int8 panels) whose shape's quantized path beats a dense matmul in
    `dtype` at a step of PROBE_TOKENS tokens, timed on one layer per shape against random
    float weights (a dense matmul's time does not depend on the values), so before any are
    loaded. Where the int8 path wins there, it wins at every size: smaller steps are bound
    by reading the weights, of which the codes are 4-8x fewer bytes."""
    winners = []
    with_panels = [layer for layer in layers if layer.int8_panels is not None]
    for (in_features, out_features, *_), group in _by_shape(with_panels).items():
        x = torch.randn(PROBE_TOKENS, in_features).to(dtype)
        dense = Linear(in_features, out_features, bias=False).to(dtype)
        if packed_weights_supported(dtype, x.device):
            dense.pack_dense(shared=False)
        quantized = best_seconds(lambda: group[0].quantized_forward(x),
                                 group[0].tensors_read(PROBE_TOKENS, quantized=True))
        if quantized < best_seconds(lambda: dense.dense_forward(x),
                                    dense.tensors_read(PROBE_TOKENS, quantized=False)):
            winners += group
    return winners


def choose_torch_int4(layers: Sequence[Linear]) -> list[str]:
    """Per shape, the largest step size (of 1, 2, 4, 8, up to the most it may serve) up to
    which torch's int4 kernel beats pagellm's (the bf16 tiles, else the float kernel) at
    every size, 30 layers timed together as a decode step reads them; the form is dropped
    where it loses at 1 token (its kernel is scalar for some dtypes and CPUs). Returns the
    shapes that kept it, with their sizes."""
    kept = []
    with_int4 = [layer for layer in layers if layer.torch_int4 is not None]
    for (in_features, out_features, *_), group in _by_shape(with_int4).items():
        most = group[0].torch_int4_max_tokens
        timed = group[:MEASURED_LAYER_TOKENS // most]
        ours = [layer.bf16_tiles or layer.quantized for layer in timed]
        theirs = [layer.torch_int4 for layer in timed]
        served = 0
        for tokens in (size for size in INT4_CANDIDATE_TOKENS if size <= most):
            x = torch.randn(tokens, in_features).to(torch.bfloat16)
            if _forms_seconds(timed, theirs, x) >= _forms_seconds(timed, ours, x):
                break
            served = tokens
        for layer in group:
            layer.torch_int4_max_tokens = served
            if served == 0:
                layer.torch_int4 = None
        if served:
            kept.append(f"{in_features}x{out_features} {served}")
    return kept


def _forms_seconds(layers: Sequence[Linear], forms: Sequence[QuantizedForm | None],
                   x: torch.Tensor) -> float:
    """One pass over `layers`, each multiplying its form of `forms` (none is None)."""
    present = [form for form in forms if form is not None]
    assert len(present) == len(layers)
    return best_seconds(lambda: [layer.quantized_forward(x, form)
                                 for layer, form in zip(layers, present, strict=True)],
                        [t for form in present for t in form_tensors(form)])


def _by_shape(layers: Sequence[Linear]) -> dict[tuple[int, int, int, int], list[Linear]]:
    """Quantized layers by (in features, out features, code bits, group size): groups of 16
    (Q6_K) cost the kernels a second scale per 32 inputs."""
    shapes: dict[tuple[int, int, int, int], list[Linear]] = defaultdict(list)
    for layer in layers:
        q = layer.quantized
        assert q is not None
        shapes[(layer.in_features, layer.out_features, q.bits, q.group_size)].append(layer)
    return shapes


def measure_max_tokens(layers: Sequence[Linear], dtype: torch.dtype) -> dict[str, int]:
    """Set each layer's `quantized_max_tokens` to the largest step size (of
    CANDIDATE_MAX_TOKENS) at which the quantized weights beat the dense ones on this CPU, 0
    if none, or ANY_TOKENS if the largest. Layers of one shape are timed together, in one
    pass over them, their weights first flushed from the caches: a model step reads them
    from memory.
    Every candidate is timed (see `max_tokens_from_wins`). Returns the sizes by shape."""
    chosen = {}
    for (in_features, out_features, bits, group_size), group in _by_shape(layers).items():
        wins = []
        for tokens in CANDIDATE_MAX_TOKENS:
            x = torch.randn(tokens, in_features).to(dtype)
            timed = group[:max(1, MEASURED_LAYER_TOKENS // tokens)]
            quantized = best_seconds(lambda: [layer.quantized_forward(x) for layer in timed],
                                     _read(timed, tokens, quantized=True))
            dense = best_seconds(lambda: [layer.dense_forward(x) for layer in timed],
                                 _read(timed, tokens, quantized=False))
            wins.append(quantized < dense)
        best = max_tokens_from_wins(wins)
        for layer in group:
            layer.quantized_max_tokens = best
        per = "" if group_size == CODE_BLOCK else f"/{group_size}"
        chosen[f"{in_features}x{out_features} Q{bits}{per}"] = best
    return chosen


def max_tokens_from_wins(wins: Sequence[bool]) -> int:
    """The largest candidate at which the quantized path won and also won at the candidate
    before (if any), 0 if none, ANY_TOKENS if the largest. Near parity, neither a noisy loss
    nor a noisy win at one size decides the larger ones: a single win past the crossover
    (a slow moment of the dense matmul at 512 tokens, say) would otherwise send every
    larger step to the slower path."""
    best = 0
    for i, tokens in enumerate(CANDIDATE_MAX_TOKENS):
        if wins[i] and (i == 0 or wins[i - 1]):
            best = tokens
    return ANY_TOKENS if best == CANDIDATE_MAX_TOKENS[-1] else best


def _read(layers: Sequence[Linear], tokens: int, quantized: bool) -> list[torch.Tensor]:
    return [t for layer in layers for t in layer.tensors_read(tokens, quantized)]


def best_seconds(fn: Callable[[], object], evicted: Sequence[torch.Tensor],
                 tries: int = 3) -> float:
    """The best of `tries` runs after a warm-up, each with `evicted` flushed from the caches
    first."""
    fn()
    best = float("inf")
    for _ in range(tries):
        evict_from_cache(evicted)
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
