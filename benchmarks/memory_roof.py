"""This machine's memory read roof: how fast its threads can read memory, in GB/s.

torch's reductions are no probe for it: on the 2-core AMX Xeon a 512 MiB sum reads at
18 GB/s in bf16 and 23 in float32, bound by their arithmetic, where plain vector loads
read 30-37. This builds a small kernel (at first use; cached after) that reads a buffer
with 512-bit or 256-bit loads over torch's threads, requesting each line a few lines
before it is read, either in order or in chunks taken in random order: the pattern of a
paged KV cache, whose blocks lie anywhere (SmolLM2's are 2 KiB a kv head).

    python benchmarks/memory_roof.py
    python benchmarks/memory_roof.py --chunk-bytes 2048 12288 65536
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
from torch.utils.cpp_extension import load_inline

from pagellm.platform import zeros_in_huge_pages

_SOURCE = r"""
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>

// XOR of every 8-byte word of the chunks `order` names (chunk_bytes each) or, where `order`
// is empty, of all of `data`; the threads split the chunks between them.
int64_t read_all(const at::Tensor& data, const at::Tensor& order, int64_t chunk_bytes) {
  const auto* base = static_cast<const uint8_t*>(data.const_data_ptr());
  const bool in_order = order.numel() == 0;
  const int64_t chunks = in_order ? data.numel() / chunk_bytes : order.numel();
  const int64_t* index = in_order ? nullptr : order.const_data_ptr<int64_t>();
  const int64_t words = chunk_bytes / 8;
  std::vector<uint64_t> partial(at::get_num_threads() * 8, 0);  // a cache line per thread
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    uint64_t sum = 0;
    for (int64_t c = begin; c < end; ++c) {
      const auto* words_of = reinterpret_cast<const uint64_t*>(
          base + (in_order ? c : index[c]) * chunk_bytes);
      // requested ahead: in order, 512 bytes on; in random order, the next chunk's line
      const uint8_t* ahead = in_order ? reinterpret_cast<const uint8_t*>(words_of) + 512
          : c + 1 < end ? base + index[c + 1] * chunk_bytes : nullptr;
      for (int64_t w = 0; w < words; w += 32) {
        if (ahead != nullptr) {
          for (int64_t line = 0; line < 256; line += 64) __builtin_prefetch(ahead + w * 8 + line);
        }
#pragma omp simd reduction(^ : sum)
        for (int64_t i = 0; i < 32; ++i) sum ^= words_of[w + i];
      }
    }
    partial[at::get_thread_num() * 8] ^= sum;
  });
  uint64_t total = 0;
  for (uint64_t value : partial) total ^= value;
  return static_cast<int64_t>(total);
}

TORCH_LIBRARY_FRAGMENT(pagellm_bench, m) { m.def("read_all", &read_all); }
"""


@functools.cache
def _build() -> None:
    load_inline(name="pagellm_memory_roof", cpp_sources=_SOURCE,
                extra_cflags=["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"],
                extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)


def read_gbps(mib: int = 512, chunk_bytes: int | None = None, tries: int = 5) -> float:
    """Best-of-`tries` GB/s of reading `mib` MiB with torch's threads: in order, or in
    chunks of `chunk_bytes` taken in random order."""
    _build()
    data = zeros_in_huge_pages((mib << 20,), torch.uint8).fill_(1)  # as the KV cache is
    step = chunk_bytes or 1 << 16  # in order: each thread reads 64 KiB at a time
    order = (torch.randperm(data.numel() // step) if chunk_bytes
             else torch.empty(0, dtype=torch.int64))
    torch.ops.pagellm_bench.read_all(data, order, step)  # warm-up
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        torch.ops.pagellm_bench.read_all(data, order, step)
        best = min(best, time.perf_counter() - start)
    return data.numel() / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--chunk-bytes", type=int, nargs="*", default=[2048])
    args = parser.parse_args()
    for threads in sorted({torch.get_num_threads(), 1}, reverse=True):
        torch.set_num_threads(threads)
        scattered = ", ".join(f"{size} B chunks in random order "
                              f"{read_gbps(args.mib, size):.1f}" for size in args.chunk_bytes)
        print(f"{threads} thread(s): in order {read_gbps(args.mib):.1f} GB/s, {scattered}")


if __name__ == "__main__":
    main()
