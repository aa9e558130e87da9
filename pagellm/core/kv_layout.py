"""How a model with sliding-window layers shares the KV cache among its layers (integers only).

vLLM's hybrid KV cache manager: the layers are cut into groups of equal size, each group all
full-attention or all sliding-window layers. There is one pool of blocks and, per layer
position within a group, one KV tensor: block b of tensor t holds, for whichever group owns b,
the keys and values of that group's t-th layer. Every block thus has one size, and a request
has one block table per group. A full-attention group keeps all its blocks; a sliding-window
group gives back the blocks no query to come can see, so that a long request costs about the
full-attention layers' memory only. Gemma 3 270M (3 global and 15 local layers): one
full-attention group and five sliding-window groups of three layers, three KV tensors.

A group smaller than the others (when the layer counts do not divide) leaves its missing
layers' share of each block it holds unused, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

SLIDING = "sliding_attention"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheLayout:
    windows: tuple[int, ...]  # per group: 0 for full attention, else its sliding window
    layer_groups: tuple[int, ...]  # per layer: the group it belongs to
    layer_tensors: tuple[int, ...]  # per layer: the KV tensor it reads and writes
    num_tensors: int  # layers per group

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def blocks_per_request(self, num_tokens: int, block_size: int,
                           max_num_batched_tokens: int) -> int:
        """The most blocks one request of `num_tokens` tokens holds: in a full-attention group
        all of its blocks; in a sliding one, those a step's chunk of up to
        `max_num_batched_tokens` queries and the window before its first query span."""
        full = cdiv(num_tokens, block_size)
        return sum(full if not window else
                   min(full, cdiv(window - 1 + max_num_batched_tokens, block_size) + 1)
                   for window in self.windows)

    def max_tokens(self, num_blocks: int, block_size: int, max_num_batched_tokens: int) -> int:
        """The longest request (in whole blocks) that `num_blocks` blocks hold."""
        low, high = 0, num_blocks
        while low < high:
            mid = (low + high + 1) // 2
            if self.blocks_per_request(mid * block_size, block_size,
                                       max_num_batched_tokens) <= num_blocks:
                low = mid
            else:
                high = mid - 1
        return low * block_size

    def describe(self) -> str:
        num_full = self.windows.count(0)
        windows = sorted({w for w in self.windows if w})
        return (f"{num_full} full-attention and {self.num_groups - num_full} sliding-window "
                f"(window {', '.join(map(str, windows))}) groups of {self.num_tensors} layers")


def hybrid_layout(layer_types: list[str] | None, window: int | None,
                  max_model_len: int) -> KVCacheLayout | None:
    """The layout of a model with both kinds of layers whose window is shorter than its
    context; None where a single group is all there is (today's path: one block table)."""
    if not layer_types or not window or window >= max_model_len:
        return None
    sliding = [i for i, kind in enumerate(layer_types) if kind == SLIDING]
    full = [i for i, kind in enumerate(layer_types) if kind != SLIDING]
    if not sliding or not full:
        return None
    size = min(len(sliding), len(full))
    windows: list[int] = []
    layer_groups = [0] * len(layer_types)
    layer_tensors = [0] * len(layer_types)
    for layers, group_window in ((full, 0), (sliding, window)):
        for start in range(0, len(layers), size):
            for tensor, layer in enumerate(layers[start:start + size]):
                layer_groups[layer], layer_tensors[layer] = len(windows), tensor
            windows.append(group_window)
    if len(windows) > 255:
        raise ValueError(f"{len(windows)} KV cache groups: at most 255 are supported.")
    return KVCacheLayout(tuple(windows), tuple(layer_groups), tuple(layer_tensors), size)
