"""Attention over the paged KV cache.

The KV cache of one layer is a tensor `[2, num_kv_heads, num_blocks, block_size,
head_dim]`: gathering a batch's blocks then yields keys already laid out as
`[kv_heads, requests, tokens, head_dim]` for batched matmuls. New keys and values are written at their slots (`block_id *
block_size + offset`); queries then read the keys of their request through its
block table. Requests are attended in two padded groups, one call each for the
whole batch: decodes (one query token each) and prefills (chunks of prompt).
Splitting keeps a long prefill chunk from padding every decode to its length.

Where the CPU kernels attend a batch-invariant step, its prefills go through the prefill
kernel and its decodes through the invariant decode kernel, whose rows are bit-identical to
the prefill kernel's: each query row's result depends only on its own query, position and
keys, so a token attends alike as a decode, in a chunk of any size, or recomputed after
preemption. (The other decode kernel sums in another order.)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F

from pagellm.kernels import (cache_kernels_available, decode_attention_invariant_available,
                             on_demand_kernels_available, paged_decode_attention,
                             paged_decode_attention_invariant, paged_prefill_attention,
                             prefill_attention_available, use_cpu_kernels, write_kv_cache)

BLOCK_DIM = 2  # the block axis of a layer's KV cache tensor
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, ...]:
    return (2, num_kv_heads, num_blocks, block_size, head_dim)


@dataclass
class AttentionGroup:
    """Tensors for attending one group of requests with a padded query."""

    query_index: torch.Tensor  # [B, Q] flat token index of each query slot (0 for padding)
    block_tables: torch.Tensor  # [B, max_blocks] block ids, padded with 0
    seq_lens: torch.Tensor  # [B] keys visible to each request's last query
    # [B, 1, Q, max_blocks * block_size] True where a key is visible; None for prompts that
    # all start at position 0, where query i sees keys 0..i (SDPA's is_causal), and where
    # the CPU kernels attend (they take positions from seq_lens and query_lens)
    mask: torch.Tensor | None
    valid_slots: torch.Tensor  # positions in the flattened [B * Q] that are real tokens
    token_index: torch.Tensor  # flat token index of each real slot, same order
    query_starts: torch.Tensor  # [B] flat token index of each request's first query
    query_lens: torch.Tensor  # [B]
    block_size: int
    members: tuple[int, ...] = ()  # the step's requests in this group, by index
    all_tokens_in_order: bool = False  # token_index is 0..T-1: the step is this group alone
    # attended by the kernels whose rows are bit-identical: the prefill kernel, and for single
    # queries the invariant decode kernel where it applies (else the prefill kernel too)
    batch_invariant: bool = False
    # torch ops' masks of sliding-window layers, by window size, built on first use
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, window: int) -> torch.Tensor | None:
        """The mask of a layer whose queries see only their last `window` keys (0: all)."""
        if window <= 0:
            return self.mask
        if window not in self.window_masks:
            num_keys = self.block_tables.shape[1] * self.block_size
            key_pos = torch.arange(num_keys, device=self.seq_lens.device)
            offsets = torch.arange(self.query_index.shape[1], device=self.seq_lens.device)
            query_pos = (self.seq_lens - self.query_lens)[:, None] + offsets[None, :]
            delta = query_pos[:, :, None] - key_pos[None, None, :]
            self.window_masks[window] = ((delta >= 0) & (delta < window))[:, None]
        return self.window_masks[window]


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once by the model runner and shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    groups: list[AttentionGroup]
    num_tokens: int
    # the tokens whose K/V is written, where some are not (positions recomputed for prompt
    # logprobs whose K/V is already in shared prefix-cache blocks); slot_mapping is theirs
    kv_write_rows: torch.Tensor | None = None
    # with layer groups of their own block tables (sliding-window layers, HybridKVCacheManager):
    # each layer's metadata, by layer index; None: every layer reads these block tables
    layer_metadata: list["AttentionMetadata"] | None = None

    def for_layer(self, index: int) -> "AttentionMetadata":
        return self if self.layer_metadata is None else self.layer_metadata[index]


def with_block_tables(metadata: AttentionMetadata, block_tables: list[list[int]],
                      slot_mapping: torch.Tensor) -> AttentionMetadata:
    """The same step over another layer group's block tables and slots: the same queries,
    positions and masks (tables of one length, so key positions line up)."""
    groups = [replace(group, block_tables=_block_table(
        group.members, block_tables, group.block_tables.shape[1], slot_mapping.device))
        for group in metadata.groups]
    return replace(metadata, slot_mapping=slot_mapping, groups=groups, layer_metadata=None)


def _block_table(members: tuple[int, ...], block_tables: list[list[int]], max_blocks: int,
                 device: torch.device) -> torch.Tensor:
    table = np.zeros((len(members), max_blocks), dtype=np.int64)
    for row, i in enumerate(members):
        blocks = block_tables[i][:max_blocks]
        table[row, : len(blocks)] = blocks
    return torch.from_numpy(table).to(device)


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    slot_mapping: torch.Tensor,
    block_size: int,
    device: torch.device,
    batch_invariant: bool = False,
    kv_write_rows: torch.Tensor | None = None,
) -> AttentionMetadata:
    """Group the step's requests; `seq_lens` count the tokens known after this step."""
    query_starts = np.concatenate([[0], np.cumsum(query_lens)[:-1]]).astype(np.int64)
    members_of_groups = [[i for i, q in enumerate(query_lens) if q == 1],
                         [i for i, q in enumerate(query_lens) if q > 1]]
    groups = [
        _build_group(members, query_starts, query_lens, seq_lens, block_tables, block_size, device)
        for members in members_of_groups if members
    ]
    invariant = batch_invariant and _kernels_attend(device)
    for group in groups:
        group.batch_invariant = invariant
    return AttentionMetadata(slot_mapping=slot_mapping, groups=groups,
                             num_tokens=int(sum(query_lens)), kv_write_rows=kv_write_rows)


def _build_group(
    members: list[int],
    query_starts: np.ndarray,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionGroup:
    q_lens = np.array([query_lens[i] for i in members], dtype=np.int64)
    s_lens = np.array([seq_lens[i] for i in members], dtype=np.int64)
    starts = query_starts[members]
    max_q = int(q_lens.max())
    max_blocks = int(-(-s_lens.max() // block_size))

    offsets = np.arange(max_q, dtype=np.int64)
    valid = offsets[None, :] < q_lens[:, None]
    query_index = np.where(valid, starts[:, None] + offsets[None, :], 0)

    mask = None
    if not _kernels_attend(device) and (max_q == 1 or np.any(s_lens > q_lens)):
        key_pos = np.arange(max_blocks * block_size, dtype=np.int64)
        query_pos = (s_lens - q_lens)[:, None] + offsets[None, :]
        mask = torch.from_numpy(key_pos[None, None, :] <= query_pos[:, :, None])[:, None].to(device)

    flat_valid = np.flatnonzero(valid.reshape(-1))
    token_index = query_index.reshape(-1)[flat_valid]
    return AttentionGroup(
        query_index=torch.from_numpy(query_index).to(device),
        block_tables=_block_table(tuple(members), block_tables, max_blocks, device),
        seq_lens=torch.from_numpy(s_lens).to(device),
        mask=mask,
        valid_slots=torch.from_numpy(flat_valid).to(device),
        token_index=torch.from_numpy(token_index).to(device),
        query_starts=torch.from_numpy(starts).to(device),
        query_lens=torch.from_numpy(q_lens).to(device),
        block_size=block_size,
        members=tuple(members),
        all_tokens_in_order=bool(np.array_equal(token_index, np.arange(sum(query_lens)))),
    )


def _kernels_attend(device: torch.device) -> bool:
    """Whether this device's decode and prefill groups both go to the CPU kernels."""
    return use_cpu_kernels(torch.empty(0, device=device)) and prefill_attention_available()


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys/values ([T, kv_heads, head_dim]) at their slots, rounded to the
    cache's dtype where it is narrower than the model's."""
    if use_cpu_kernels(kv_cache) and cache_kernels_available(kv_cache.dtype):
        write_kv_cache(kv_cache, key, value, slot_mapping)
    else:
        write_kv_with_torch_ops(kv_cache, key, value, slot_mapping)


def write_kv_with_torch_ops(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            slot_mapping: torch.Tensor) -> None:
    _, num_kv_heads, _, _, head_dim = kv_cache.shape
    for half, rows in ((0, key), (1, value)):
        as_bytes(kv_cache[half]).view(num_kv_heads, -1, head_dim).index_copy_(
            1, slot_mapping, as_bytes(_rounded(rows.transpose(0, 1), kv_cache.dtype)))


def _rounded(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 saturates at its largest finite value (a cast would give NaN on some backends)."""
    if dtype in _FP8_DTYPES:
        largest = torch.finfo(dtype).max
        rows = rows.clamp(-largest, largest)
    return rows.to(dtype)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as uint8, for the copies torch does not implement in fp8; others as is."""
    return tensor.view(torch.uint8) if tensor.dtype in _FP8_DTYPES else tensor


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D] -> [T, H * D]; with a `window` (sliding-window
    layers), each query sees only its last `window` keys."""
    rows = metadata.kv_write_rows
    if rows is None:
        write_kv(kv_cache, key, value, metadata.slot_mapping)
    elif rows.numel():
        write_kv(kv_cache, key[rows], value[rows], metadata.slot_mapping)
    if len(metadata.groups) == 1 and metadata.groups[0].all_tokens_in_order:
        return _attend_group(query, kv_cache, metadata.groups[0], scale, window)
    num_tokens, num_heads, head_dim = query.shape
    out = query.new_empty(num_tokens, num_heads * head_dim)
    for group in metadata.groups:
        out.index_copy_(0, group.token_index,
                        _attend_group(query, kv_cache, group, scale, window))
    return out


def attends_with_invariant_decode(group: AttentionGroup, kv_cache: torch.Tensor) -> bool:
    """Whether the group is a batch-invariant step's decodes (one query each) that the
    invariant decode kernel attends: bit-identical to the prefill kernel's rows (which the
    step's other tokens get), with the lanes kept busy."""
    return (group.query_index.shape[1] == 1 and group.batch_invariant
            and kv_cache.shape[-1] % 16 == 0 and use_cpu_kernels(kv_cache)
            and cache_kernels_available(kv_cache.dtype)
            and decode_attention_invariant_available())


def _attend_group(query: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup,
                  scale: float, window: int = 0) -> torch.Tensor:
    num_reqs, max_q = group.query_index.shape
    _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
    if (max_q == 1 and not group.batch_invariant and use_cpu_kernels(kv_cache)
            and on_demand_kernels_available()):
        queries = query if group.all_tokens_in_order else query[group.token_index]
        return paged_decode_attention(queries, kv_cache, group.block_tables, group.seq_lens,
                                      scale, window)
    if attends_with_invariant_decode(group, kv_cache):
        queries = query if group.all_tokens_in_order else query[group.token_index]
        return paged_decode_attention_invariant(queries, kv_cache, group.block_tables,
                                                group.seq_lens, scale, window)
    invariant_kernels = use_cpu_kernels(kv_cache) and cache_kernels_available(kv_cache.dtype)
    if (max_q > 1 or group.batch_invariant) and invariant_kernels and prefill_attention_available():
        return paged_prefill_attention(query, kv_cache, group.block_tables, group.seq_lens,
                                       group.query_starts, group.query_lens,
                                       group.token_index.numel(), scale, window)
    kv = kv_cache[:, :, group.block_tables]  # [2, KVH, B, blocks, block_size, D]
    kv = kv.view(2, num_kv_heads, num_reqs, -1, head_dim).to(query.dtype)  # [2, KVH, B, L, D]
    mask = group.mask_for(window)
    if max_q == 1:
        return _attend_decode(query[group.token_index], kv, mask, scale)
    q = query[group.query_index].transpose(1, 2)  # [B, H, Q, D]
    kv = kv.transpose(1, 2)  # [2, B, KVH, L, D]
    if mask is None:
        # Prompts from position 0: keys past max_q are never visible, and with as many keys
        # as queries is_causal means the same on every backend. Without a mask, the fused
        # kernel skips key blocks past each query block: at 2048 tokens, 81 ms a layer on
        # 2 cores instead of 145 ms.
        kv = kv[..., :max_q, :]
    out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, scale=scale,
                                         is_causal=mask is None, enable_gqa=True)
    out = out.transpose(1, 2).reshape(num_reqs * max_q, -1)
    return out[group.valid_slots]


def _attend_decode(query: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """One query per request: two batched matmuls over (kv head, request), no copies of K/V.

    The fused SDPA kernels are tuned for long queries; with a single query row
    plain matmuls do less work and need no repeated K/V for grouped-query attention.
    """
    num_reqs, num_heads, head_dim = query.shape
    num_kv_heads = kv.shape[1]
    q = query.view(num_reqs, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    # In float32: in bf16 (8 bits of mantissa) the rounded scores and probabilities shift
    # the output enough to change the greedy tokens of small models after a few steps.
    keys, values = kv[0].float(), kv[1].float()
    scores = torch.matmul(q.float(), keys.transpose(-1, -2)) * scale  # [KVH, B, G, L]
    scores.masked_fill_(~mask.transpose(0, 1), float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), values).to(query.dtype)  # [KVH, B, G, D]
    return out.transpose(0, 1).reshape(num_reqs, num_heads * head_dim)
