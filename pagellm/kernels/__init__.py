"""Hand-written CPU kernels, compiled once per machine with its C++ compiler.

They are built on first use (see build.py) and register themselves as
`torch.ops.pagellm.*`; a later start loads the built library directly. Without a
compiler, or with `PAGELLM_CPU_KERNELS=0`, the engine falls back to plain torch ops:
same results, slower. `python -m pagellm.kernels` builds them ahead of time.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable

import torch

from pagellm.kernels.build import (DEFAULT_UNITS, INT8_FORMS_DEFINES, INT8_FORMS_UNITS,
                                   ON_DEMAND_DEFINES, ON_DEMAND_UNITS, build_library)
from pagellm.logger import init_logger

logger = init_logger(__name__)

# The KV cache dtypes of every default configuration (bf16, float32 on CPUs without bf16):
# the default library's attention and cache writes read and write these; fp16 and fp8
# caches go to the on-demand library's copies.
DEFAULT_CACHE_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def cpu_kernels_available() -> bool:
    """Build (or load the cached build of) the default path's CPU kernels; False if they
    cannot be used."""
    if os.environ.get("PAGELLM_CPU_KERNELS", "1") == "0":
        return False
    if build_library("pagellm_cpu_kernels", DEFAULT_UNITS):
        return True
    logger.warning("CPU kernels unavailable, using torch ops instead (slower)")
    return False


@functools.cache
def on_demand_kernels_available() -> bool:
    """Build (or load) the kernels of ON_DEMAND_UNITS, which only some configurations call:
    the loader and the model runner ask for them when theirs does, the ops' wrappers below
    before any call."""
    return cpu_kernels_available() and build_library("pagellm_cpu_kernels_on_demand",
                                                     ON_DEMAND_UNITS, ON_DEMAND_DEFINES)


def cache_kernels_available(cache_dtype: torch.dtype) -> bool:
    """Whether the library holding the attention and cache writes of a KV cache of this dtype
    is loaded: the default one for DEFAULT_CACHE_DTYPES, the on-demand one (built now where
    it is not) for the others."""
    if cache_dtype in DEFAULT_CACHE_DTYPES:
        return cpu_kernels_available()
    return on_demand_kernels_available()


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, window: int = 0) -> torch.Tensor:
    """query [N, H, D] (one token per request) -> [N, H * D], keys read in place from the cache
    (with a `window`, each query's last `window` keys only)."""
    _require_on_demand_kernels("paged_decode_attention")
    query = query.contiguous()
    out = torch.empty_like(query)
    torch.ops.pagellm.paged_decode_attention(out, query, kv_cache, block_tables, seq_lens, scale,
                                             window)
    return out.view(query.shape[0], -1)


def write_kv_cache(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """key, value [T, KVH, D] (rows contiguous) -> their slots of kv_cache [2, KVH, blocks,
    block_size, D], rounded to its dtype."""
    _cache_op("write_kv_cache", kv_cache)(kv_cache, key, value, slot_mapping)


def _cache_op(name: str, kv_cache: torch.Tensor) -> Callable[..., None]:
    """The op `name` for a KV cache of this dtype: the default library's, or for fp16 and fp8
    caches the on-demand library's copy (see DEFAULT_CACHE_DTYPES)."""
    if kv_cache.dtype in DEFAULT_CACHE_DTYPES:
        return getattr(torch.ops.pagellm, name)
    _require_on_demand_kernels(name)
    return getattr(torch.ops.pagellm, f"{name}_other_caches")


def _require_on_demand_kernels(op: str) -> None:
    if not on_demand_kernels_available():
        raise RuntimeError(f"pagellm's CPU kernel {op} could not be built on this machine "
                           "(see the warning above); the default path does not need it")


def use_cpu_kernels(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and cpu_kernels_available()


def rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """x [T, size] = rms_norm(x) * weight, in place."""
    torch.ops.pagellm.rms_norm(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> None:
    """residual += x, then x = rms_norm(residual) * weight; both in place, both [T, size]."""
    torch.ops.pagellm.add_rms_norm(x, residual, weight, eps)


def rotary_embedding_(x: torch.Tensor, angles: torch.Tensor) -> None:
    """Rotate x [T, heads, dim] in place by angles [T, dim] float32 (cos half, then sin half)."""
    torch.ops.pagellm.rotary_embedding(x, angles)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, then up) -> silu(gate) * up [T, I]."""
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    torch.ops.pagellm.silu_and_mul(out, gate_up)
    return out


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, then up) -> gelu(gate, approximate="tanh") * up [T, I]."""
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    torch.ops.pagellm.gelu_tanh_and_mul(out, gate_up)
    return out


def quantized_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor | None, bits: int, out_features: int,
                     panels_only: bool = False) -> torch.Tensor:
    """x [M, K] @ W^T with W held as per-32- or per-16-group codes (see quantized_linear.cpp)
    -> [M, N].
    `panels_only`: one order of sums at every M, so each row's result is batch-invariant."""
    _require_on_demand_kernels("quantized_linear")
    x = x.contiguous()
    out = x.new_empty(x.shape[0], out_features)
    empty = scales.new_empty(0)
    torch.ops.pagellm.quantized_linear(out, x, codes, scales, empty if zeros is None else zeros,
                                       bits, panels_only)
    return out


@functools.cache
def prefill_attention_available() -> bool:
    """Whether paged_prefill_attention was compiled: it needs AVX2 and FMA."""
    return cpu_kernels_available() and hasattr(torch.ops.pagellm, "paged_prefill_attention")


def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            query_starts: torch.Tensor, query_lens: torch.Tensor,
                            num_queries: int, scale: float, window: int = 0) -> torch.Tensor:
    """Causal attention of each request's chunk (query_lens[n] rows of query [T, H, D] from
    query_starts[n], at the last positions of its seq_lens[n]) over its cached keys (with a
    `window`, each query's last `window` keys only) -> [num_queries, H * D], the chunks one
    after another, in query's dtype."""
    out = query.new_empty(num_queries, query.shape[1] * query.shape[2], dtype=torch.float32)
    _cache_op("paged_prefill_attention", kv_cache)(out, query.float(), kv_cache, block_tables,
                                                   seq_lens, query_starts, query_lens, scale,
                                                   window)
    return out.to(query.dtype)


@functools.cache
def decode_attention_invariant_available() -> bool:
    """Whether paged_decode_attention_invariant was compiled: it needs AVX2 and FMA."""
    return (cpu_kernels_available()
            and hasattr(torch.ops.pagellm, "paged_decode_attention_invariant"))


def paged_decode_attention_invariant(query: torch.Tensor, kv_cache: torch.Tensor,
                                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                     scale: float, window: int = 0) -> torch.Tensor:
    """query [N, H, D] (one token per request, D a multiple of 16) -> [N, H * D], bit-identical
    to paged_prefill_attention's rows for the same tokens (the batch-invariant engine's
    decode-only steps), and faster: its lanes hold keys or dims, not the few query heads of a
    kv head."""
    out = query.new_empty(query.shape[0], query.shape[1] * query.shape[2], dtype=torch.float32)
    _cache_op("paged_decode_attention_invariant", kv_cache)(out, query.float(), kv_cache,
                                                            block_tables, seq_lens, scale,
                                                            window)
    return out.to(query.dtype)


@functools.cache
def int8_matmul_available() -> bool:
    """Whether quantized_linear_int8 was compiled: it needs AVX2 (vpmaddubsw)."""
    return cpu_kernels_available() and hasattr(torch.ops.pagellm, "quantized_linear_int8")


@functools.cache
def int8_other_forms_available() -> bool:
    """Build (or load) the library of INT8_FORMS_UNITS, whose
    quantized_linear_int8_other_forms multiplies the int8 panels with float32 factors;
    quantized_linear_int8 hands those over to it."""
    return cpu_kernels_available() and build_library("pagellm_cpu_kernels_int8_forms",
                                                     INT8_FORMS_UNITS, INT8_FORMS_DEFINES)


def require_int8_other_forms() -> None:
    if not int8_other_forms_available():
        raise RuntimeError("pagellm's int8 kernel for float32 factors (K-quants) could not be "
                           "built on this machine (see the warning above)")


def quantized_linear_int8(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor,
                          zeros: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] rounded to int8 per 32 inputs @ W^T, W's 4-bit (uint8 panels, a code or two
    per byte) or 8-bit (int8 panels) codes in the kernel's layout (see
    quantized_linear_int8.cpp) -> [M, N]."""
    x = x.contiguous()
    out = x.new_empty(x.shape[0], out_features)
    torch.ops.pagellm.quantized_linear_int8(out, x, panels, scales, zeros)
    return out


@functools.cache
def bf16_tiles_available() -> bool:
    """Whether quantized_linear_bf16_tiles was compiled (AMX-BF16) and the OS grants the
    tiles (and PAGELLM_AMX is not 0)."""
    return (on_demand_kernels_available()
            and hasattr(torch.ops.pagellm, "bf16_tiles_permitted")
            and torch.ops.pagellm.bf16_tiles_permitted())


def quantized_linear_bf16_tiles(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor,
                                zeros: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] bf16 @ W^T, W's 4-bit (uint8) or 8-bit (int8) codes in the kernel's tiles (see
    quantized_linear_bf16_amx.cpp) widened to bf16 -> [M, N] bf16."""
    x = x.contiguous()
    out = x.new_empty(x.shape[0], out_features)
    torch.ops.pagellm.quantized_linear_bf16_tiles(out, x, panels, scales, zeros)
    return out


def evict_from_cache(tensors: Iterable[torch.Tensor]) -> None:
    """Flush these CPU tensors' bytes (oneDNN's packed ones too) from the caches (see
    cache_eviction.cpp); nothing where the op was not built."""
    if not (on_demand_kernels_available() and hasattr(torch.ops.pagellm, "evict_from_cache")):
        return
    starts, sizes = [], []
    for t in tensors:
        if t.device.type != "cpu":
            continue
        if t.layout == torch._mkldnn:  # type: ignore[attr-defined]
            starts.append(torch.ops.mkldnn.data_ptr(t))
            sizes.append(torch.ops.mkldnn._nbytes(t))
        else:
            starts.append(t.data_ptr())
            sizes.append(t.numel() * t.element_size())
    torch.ops.pagellm.evict_from_cache(starts, sizes)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (float32, bf16 or fp16) -> [R] int64, as logits.argmax(dim=-1) (first of
    ties, NaN wins)."""
    if not (use_cpu_kernels(logits) and logits.dim() == 2 and logits.is_contiguous()
            and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    torch.ops.pagellm.argmax_rows(out, logits)
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None,
                        out: torch.Tensor) -> None:
    """out = logits [R, V] (float32, bf16 or fp16, contiguous) with -inf where a row's int32
    bitmask [G, ceil(V / 32)] has a 0 bit; `rows`: the logits row of each bitmask row (None:
    bitmask row r is row r). `out` may be `logits` itself (in place)."""
    if rows is None:
        rows = torch.arange(bitmask.shape[0], dtype=torch.int64)
    torch.ops.pagellm.apply_token_bitmask(out, logits, bitmask, rows)


def subtract_log_exponential_(logits: torch.Tensor, keys: torch.Tensor) -> None:
    """logits [R, V] float32 -= log(q), q ~ Exp(1) hashed from each row's key (see noise.py)."""
    torch.ops.pagellm.subtract_log_exponential(logits, keys)
