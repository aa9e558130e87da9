"""What the machine offers: device, dtype and memory."""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import mmap

import torch

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}

# vLLM's names; `fp8` is e4m3 there too
_FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                  "fp8_e5m2": torch.float8_e5m2}


_HUGE_PAGE_BYTES = 2 << 20


def zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype,
                        fault_in: bool = True) -> torch.Tensor:
    """A zeroed CPU tensor in fresh anonymous memory, 2 MiB-aligned, which Linux is asked to
    back with 2 MiB pages (MADV_HUGEPAGE): where transparent huge pages are `madvise`-only,
    a common default, a plain allocation gets 4 KiB pages. A KV cache is read a block at a
    time in random order, and with 4 KiB pages nearly every block costs a TLB miss:
    SmolLM2's decode attention at batch 64 over 30 layers took 19.0 ms with them and 16.4 ms
    with 2 MiB pages (146.8 and 119.0 ms at 1000 tokens of context). With `fault_in`, the
    pages are written now, as torch.zeros does. Without, fresh anonymous memory reads as
    zeros anyway, and each page is faulted in by the first step that writes it: the zeroing
    of 2 MiB, on first use only. The KV cache is allocated so, because faulting gigabytes in
    costs a start-up seconds (tens in a VM, whose host backs memory on first touch), and a
    background thread doing it held the memory-map lock that the engine's large mallocs
    wait for: first requests took 3 to 15 s on two cores, at any thread priority."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE_BYTES,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -raw.data_ptr() % _HUGE_PAGE_BYTES
    if hasattr(mmap, "MADV_HUGEPAGE") and nbytes:
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    tensor = raw[offset:offset + nbytes]
    return (tensor.zero_() if fault_in else tensor).view(dtype).view(shape)


_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later
_PAGE_BYTES = 4096


def fault_in(address: int, nbytes: int) -> bool:
    """Has Linux back [address, address + nbytes) of an anonymous mapping with memory now, as
    the first write to each page would (madvise MADV_POPULATE_WRITE), leaving what the pages
    hold as it is. False where the kernel does not offer it."""
    start = address - address % _PAGE_BYTES
    end = -(-(address + nbytes) // _PAGE_BYTES) * _PAGE_BYTES
    return _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                           _MADV_POPULATE_WRITE) == 0


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def copies_in_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the CPU `tensors` side by side in one allocation of 2 MiB pages, each from
    a 64-byte boundary. For weights that every decode step streams through whole: at one
    decoding request the step is bound by how fast they arrive, and with 4 KiB pages
    (a plain allocation where transparent huge pages are `madvise`-only) each 4 KiB costs
    a TLB miss along the way."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    padded = [-(-size // 64) * 64 for size in sizes]
    starts = [0, *itertools.accumulate(padded)]
    arena = zeros_in_huge_pages((starts[-1],), torch.uint8, fault_in=False)
    copies = []
    for tensor, start, size in zip(tensors, starts, sizes):
        copy = arena[start:start + size].view(tensor.dtype).view(tensor.shape)
        copies.append(copy.copy_(tensor))
    return copies


_PR_SET_NAME = 15


def name_this_process(name: str) -> None:
    """Linux: the name `ps`, `top` and /proc/PID/comm show (15 bytes at most), so that an
    engine core forked from the server is told apart from it."""
    try:
        _libc().prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


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


def resolve_dtypes(dtype: str, kv_cache_dtype: str, device: torch.device,
                   int8_gguf: bool) -> tuple[torch.dtype, torch.dtype]:
    """The model's compute dtype and its KV cache's. `int8_gguf`: a GGUF whose projections
    multiply their codes with activations rounded to int8 (as llama.cpp does). Under `auto`
    on a CPU it computes the rest (attention, norms, residuals) in float32 and keeps its KV
    cache in bf16: on SmolLM2 Q4_1, 16 of 40 greedy continuations match the exact model's
    against 11 with bf16 activations (`pagellm bench fidelity`), at the same step time,
    since the int8 projections dominate it. bf16 on every CPU, with bf16 instructions or
    not: storing and widening it is integer work, so a CPU with AVX2 only gives the very
    bits of one with AMX, and its decode attention reads half the bytes (on a 2-core AVX2
    EPYC, 128 requests 10% faster offline than with a float32 cache)."""
    if int8_gguf and dtype == "auto" and device.type == "cpu":
        compute = torch.float32
        if kv_cache_dtype == "auto":
            return compute, torch.bfloat16
        return compute, resolve_kv_cache_dtype(kv_cache_dtype, compute)
    compute = resolve_dtype(dtype, device)
    return compute, resolve_kv_cache_dtype(kv_cache_dtype, compute)


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
