"""The KV cache's tensors in both tiers, and the step's block copies between them.

The first tier is a tensor per layer (or per layer group, with a KVCacheLayout); the second
lies in host memory (pinned when the first is on CUDA) or in a memory-mapped file. A step's
copies run before its forward: stores first, because a block evicted from the first tier may
be reused by this very step, then loads.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import torch

from pagellm.core.kv_layout import KVCacheLayout
from pagellm.core.sched_output import KVTransferStats, SchedulerOutput
from pagellm.model.arch import ArchConfig
from pagellm.model.attention import BLOCK_DIM, as_bytes, kv_cache_shape
from pagellm.platform import fault_in, zeros_in_huge_pages

# blocks of the first tier whose pages one idle moment faults in: 2 MiB of SmolLM2's bf16 keys
# or values of a kv head, a few ms in a VM whose host backs memory on first touch
_FAULT_IN_BLOCKS = 1024


class KVTiers:
    """The model runner's KV storage (ModelRunner derives from it and sets these)."""

    arch: ArchConfig
    block_size: int
    device: torch.device
    kv_cache_dtype: torch.dtype
    kv_caches: list[torch.Tensor]
    offload_caches: list[torch.Tensor]
    kv_layout: KVCacheLayout | None
    _unfaulted: Iterator[tuple[int, int]]  # pieces of the first tier not yet faulted in

    def block_bytes(self) -> int:
        """Bytes of one block across its KV tensors (one a layer, or, with `kv_layout`, one a
        layer of a group): 2 x block_size x kv_heads x head_dim x dtype x tensors."""
        arch = self.arch
        element = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return (2 * self.block_size * arch.num_key_value_heads * arch.head_dim * element
                * self._num_kv_tensors())

    def _num_kv_tensors(self) -> int:
        return self.arch.num_hidden_layers if self.kv_layout is None else self.kv_layout.num_tensors

    def _cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        arch = self.arch
        return kv_cache_shape(num_blocks, self.block_size, arch.num_key_value_heads, arch.head_dim)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Zeroed, so that padding slots read by a gather are finite and masked out cleanly; on
        CPU in 2 MiB pages, which spare decode attention a TLB miss per block, each faulted in
        by the step that first writes it. With `kv_layout`, layers share tensors."""
        shape, tensors = self._cache_shape(num_blocks), range(self._num_kv_tensors())
        if self.device.type != "cpu":
            caches = [torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
                      for _ in tensors]
        else:
            caches = [zeros_in_huge_pages(shape, self.kv_cache_dtype, fault_in=False)
                      for _ in tensors]
        self.kv_caches = (caches if self.kv_layout is None else
                          [caches[tensor] for tensor in self.kv_layout.layer_tensors])
        self._unfaulted = iter(self._kv_cache_pieces() if self.device.type == "cpu" else [])

    def fault_in_kv_cache(self) -> bool:
        """Faults in the next piece of the CPU first tier's pages, keeping what they hold;
        returns whether pieces remain. The engine calls it while it has nothing to do: each
        page would otherwise be faulted in by the step that first writes it, which in a VM
        costs a fresh server's first busy minutes about a tenth of their steps' time."""
        piece = next(self._unfaulted, None)
        if piece is None or not fault_in(*piece):
            self._unfaulted = iter(())
            return False
        return True

    def _kv_cache_pieces(self) -> list[tuple[int, int]]:
        """(address, bytes) of the first tier's pages in the order the block pool first hands
        blocks out, lowest ids first: _FAULT_IN_BLOCKS blocks of every tensor's keys and
        values of each kv head, then the next ones."""
        caches = list({cache.data_ptr(): cache for cache in self.kv_caches}.values())
        planes = [plane for cache in caches for plane in cache.flatten(0, BLOCK_DIM - 1)]
        num_blocks = planes[0].shape[0] if planes else 0
        return [(plane[first:].data_ptr(),
                 plane[first:first + _FAULT_IN_BLOCKS].numel() * plane.element_size())
                for first in range(0, num_blocks, _FAULT_IN_BLOCKS) for plane in planes]

    def allocate_offload_cache(self, num_blocks: int, path: str | None = None) -> None:
        """The second tier, laid out per layer like the first: in host memory (pinned when the
        first tier is on CUDA) or, with `path`, in a file mapped shared, created or grown."""
        shape = self._cache_shape(num_blocks)
        layers = self.arch.num_hidden_layers
        if path is not None:
            mapped = torch.from_file(path, shared=True, size=layers * math.prod(shape),
                                     dtype=self.kv_cache_dtype)
            self.offload_caches = list(mapped.view(layers, *shape).unbind(0))
            return
        pinned = self.device.type == "cuda"
        self.offload_caches = [torch.empty(shape, dtype=self.kv_cache_dtype, pin_memory=pinned)
                               for _ in range(layers)]

    def _copy_blocks(self, pairs: list[tuple[int, int]], sources: list[torch.Tensor],
                     targets: list[torch.Tensor]) -> float:
        """Copy blocks `pairs[i][0]` of `sources` to `pairs[i][1]` of `targets` in every layer:
        one gather, one transfer and one scatter per layer. Returns the seconds it took."""
        start = time.perf_counter()
        source_index = torch.tensor([p[0] for p in pairs], dtype=torch.long,
                                    device=sources[0].device)
        target_index = torch.tensor([p[1] for p in pairs], dtype=torch.long,
                                    device=targets[0].device)
        for source, target in zip(sources, targets):
            as_bytes(target).index_copy_(
                BLOCK_DIM, target_index,
                as_bytes(source.index_select(BLOCK_DIM, source_index).to(target.device)))
        self._synchronize()
        return time.perf_counter() - start

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _transfer(self, step: SchedulerOutput) -> KVTransferStats:
        stats = KVTransferStats()
        if step.kv_stores:
            stats.num_stores, stats.stored_blocks = 1, len(step.kv_stores)
            stats.store_bytes = len(step.kv_stores) * self.block_bytes()
            stats.store_seconds = self._copy_blocks(step.kv_stores, self.kv_caches,
                                                    self.offload_caches)
        if step.kv_loads:
            stats.num_loads, stats.loaded_blocks = 1, len(step.kv_loads)
            stats.load_bytes = len(step.kv_loads) * self.block_bytes()
            stats.load_seconds = self._copy_blocks(step.kv_loads, self.offload_caches,
                                                   self.kv_caches)
        return stats

    @torch.inference_mode()
    def measure_copy_cost(self, num_blocks: int = 16) -> tuple[float, float]:
        """(seconds of fixed cost per transfer, bytes per second) of a store between the tiers:
        the time of a one-block copy, and the rate of an up-to-`num_blocks` copy (fixed cost
        included, so a slight underestimate), both of still empty blocks."""
        count = min(num_blocks, self.kv_caches[0].shape[BLOCK_DIM],
                    self.offload_caches[0].shape[BLOCK_DIM])
        pairs = [(index, index) for index in range(count)]
        self._copy_blocks(pairs, self.kv_caches, self.offload_caches)  # warm-up
        latency = self._copy_blocks(pairs[:1], self.kv_caches, self.offload_caches)
        seconds = self._copy_blocks(pairs, self.kv_caches, self.offload_caches)
        return latency, count * self.block_bytes() / max(seconds, 1e-9)
