"""What the machine offers: device, dtype and memory."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}

# vLLM's names; `fp8` is e4m3 there too
_FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                  "fp8_e5m2": torch.float8_e5m2}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cpu_supports_bf16() -> bool:
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` is bf16 where the hardware computes it natively (CUDA with bf16, AVX512-BF16/AMX CPUs)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_supports_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}.")
    return _DTYPES[dtype]


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """`auto` stores keys and values in the model's dtype, as vLLM does. A narrower one
    (bfloat16 under a float32 model) halves the cache's bytes: twice the tokens fit, and
    decode attention, bound by reading them, gets faster; keys and values are rounded once
    when stored, and attention still computes in float32. fp8 (e4m3, as vLLM's `fp8`;
    or e5m2) quarters float32's bytes, with values stored unscaled (vLLM's default
    scale of 1.0), e4m3 saturating at +-448."""
    if kv_cache_dtype == "auto":
        return model_dtype
    choices = {**_DTYPES, **_FP8_KV_DTYPES}
    if kv_cache_dtype not in choices:
        raise ValueError(f"unsupported kv_cache_dtype {kv_cache_dtype!r}; choose auto, "
                         f"{', '.join(choices)}.")
    return choices[kv_cache_dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
