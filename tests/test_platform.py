"""Host memory for the KV cache: zeroed, 2 MiB-aligned, and in 2 MiB pages where Linux grants
them; the GPU's KV budget; the dtypes `auto` resolves to."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import pagellm.platform as platform
from pagellm.config import CacheConfig
from pagellm.platform import copies_in_huge_pages, resolve_dtypes, zeros_in_huge_pages


def anon_huge_kib(start: int, end: int) -> int:
    """AnonHugePages of this process's mappings that overlap [start, end), from smaps."""
    total, overlaps = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) > 4:
            low, high = (int(part, 16) for part in fields[0].split("-"))
            overlaps = low < end and start < high
        elif overlaps and fields[0] == "AnonHugePages:":
            total += int(fields[1])
    return total


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_the_tensor_is_zeroed_aligned_and_writable(dtype: torch.dtype) -> None:
    shape = (2, 3, 40, 16, 64)
    cache = zeros_in_huge_pages(shape, dtype)
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert cache.data_ptr() % (2 << 20) == 0
    assert not cache.float().any()
    cache[1, 2, 39, 15, 63] = 1.0
    assert cache.float().sum().item() == 1.0


@pytest.mark.skipif(sys.platform != "linux", reason="madvise and smaps are Linux's")
def test_linux_backs_it_with_huge_pages_where_they_are_on_request() -> None:
    """Where transparent huge pages are `madvise`-only, a plain allocation gets none: any
    huge page in the region comes from the advice."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[madvise]" not in mode.read_text():
        pytest.skip("transparent huge pages are not madvise-only here")
    cache = zeros_in_huge_pages((64, 1 << 20), torch.uint8)  # 64 MiB
    cache.fill_(1)  # the pages are taken when first written
    assert anon_huge_kib(cache.data_ptr(), cache.data_ptr() + cache.numel()) > 0



def test_copies_keep_values_dtypes_and_shapes_each_from_a_cache_line() -> None:
    tensors = [torch.randn(3, 5), torch.randint(-128, 127, (7,), dtype=torch.int8),
               torch.randn(2, 9).bfloat16(), torch.randint(0, 255, (4, 3, 2), dtype=torch.uint8)]
    copies = copies_in_huge_pages(tensors)
    for tensor, copy in zip(tensors, copies):
        assert copy.dtype == tensor.dtype and copy.shape == tensor.shape
        assert torch.equal(copy, tensor) and copy.data_ptr() % 64 == 0
        assert copy.data_ptr() != tensor.data_ptr()
    assert copies[0].data_ptr() % (2 << 20) == 0
    ends = [c.data_ptr() + c.numel() * c.element_size() for c in copies]
    assert all(end <= start for end, start in zip(ends, [c.data_ptr() for c in copies[1:]]))


CPU = torch.device("cpu")


@pytest.mark.parametrize("has_bf16", [True, False], ids=["bf16-cpu", "no-bf16-cpu"])
def test_auto_on_an_int8_gguf_computes_in_float32(has_bf16: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 activations around the int8 projections and the KV cache in bf16, whether
    the CPU has bf16 instructions or not (the same bits on either); anything asked for
    explicitly is kept. Other models' `auto` follows the CPU."""
    monkeypatch.setattr(platform, "cpu_supports_bf16", lambda: has_bf16)
    low = torch.bfloat16 if has_bf16 else torch.float32
    assert resolve_dtypes("auto", "auto", CPU, True) == (torch.float32, torch.bfloat16)
    assert resolve_dtypes("auto", "fp8", CPU, True) == (torch.float32, torch.float8_e4m3fn)
    assert resolve_dtypes("bfloat16", "auto", CPU, True) == (torch.bfloat16, torch.bfloat16)
    assert resolve_dtypes("float32", "auto", CPU, True) == (torch.float32, torch.float32)
    assert resolve_dtypes("auto", "auto", CPU, False) == (low, low)


GIB = 1 << 30


def test_the_gpu_budget_is_vllms_share_less_weights_and_activations() -> None:
    cache = CacheConfig(gpu_memory_utilization=0.5)
    assert cache.gpu_kv_cache_bytes(total=100 * GIB, weights=10 * GIB, activation_peak=2 * GIB,
                                    free=88 * GIB) == 38 * GIB


def test_an_explicit_gpu_budget_replaces_the_share() -> None:
    cache = CacheConfig(gpu_memory_utilization=0.5, kv_cache_memory=3 * GIB)
    assert cache.gpu_kv_cache_bytes(total=100 * GIB, weights=10 * GIB, activation_peak=2 * GIB,
                                    free=88 * GIB) == 3 * GIB


@pytest.mark.parametrize("explicit", [None, 60 * GIB])
def test_a_gpu_shared_with_another_engine_gives_a_share_of_what_is_free(
        explicit: int | None) -> None:
    cache = CacheConfig(gpu_memory_utilization=0.9, kv_cache_memory=explicit)
    assert cache.gpu_kv_cache_bytes(total=100 * GIB, weights=10 * GIB, activation_peak=2 * GIB,
                                    free=20 * GIB) == 16 * GIB
