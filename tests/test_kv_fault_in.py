"""An engine core idle for a second faults its CPU KV cache's pages in ahead of use (a piece
at a time, keeping what they hold), so that a fresh server's first busy minutes do not pay
for it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pagellm import LLM
from pagellm.engine.core_client import Shutdown, _step_loop
from pagellm.platform import fault_in, zeros_in_huge_pages

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="madvise and smaps are Linux's")


def resident_kib(tensors: list[torch.Tensor]) -> int:
    """Rss of this process's mappings that overlap any of `tensors`, from smaps."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]
    total, overlaps = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) > 4:
            low, high = (int(part, 16) for part in fields[0].split("-"))
            overlaps = any(low < end and start < high for start, end in spans)
        elif overlaps and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_fault_in_backs_the_pages_and_keeps_what_they_hold() -> None:
    cache = zeros_in_huge_pages((8, 1 << 20), torch.uint8, fault_in=False)  # 8 MiB
    cache[3, 5] = 7  # one page written already
    assert resident_kib([cache]) < 4 << 10
    assert fault_in(cache[1:].data_ptr() + 100, 6 << 20)  # not page-aligned: rounded out
    assert resident_kib([cache]) >= 6 << 10
    assert cache[3, 5].item() == 7 and cache.sum().item() == 7


class _IdleConnection:
    """A front-end that sends nothing for `quiet` polls, then asks the core to stop."""

    def __init__(self, quiet: int) -> None:
        self.quiet = quiet

    def poll(self, timeout: float = 0.0) -> bool:
        self.quiet -= 1
        return self.quiet < 0

    def recv(self) -> object:
        return Shutdown()


class _BusyConnection(_IdleConnection):
    """A front-end whose next message is always there: the core never idles."""

    def poll(self, timeout: float = 0.0) -> bool:
        return True


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the KV cache is the GPU's memory")
def test_an_idle_core_faults_its_kv_cache_in_until_a_message_comes(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256,
              num_gpu_blocks_override=8192)
    core = llm.engine.core
    caches = core.runner.kv_caches
    size_kib = sum(c.numel() * c.element_size() for c in caches) >> 10
    assert resident_kib(caches) < size_kib // 2
    pieces = len(core.runner._kv_cache_pieces())  # 8 a plane (8 MiB of 16-dim heads)
    _step_loop(core, _BusyConnection(0), 0)  # a message at once: stops at the Shutdown
    assert resident_kib(caches) < size_kib // 2
    _step_loop(core, _IdleConnection(quiet=1 + pieces // 2), 0)  # the first poll: the idle wait
    assert 0 < resident_kib(caches) < size_kib
    _step_loop(core, _IdleConnection(quiet=1 + pieces), 0)
    assert resident_kib(caches) >= size_kib
    assert not core.runner.fault_in_kv_cache()  # all done
