"""Paged attention against a plain per-request causal attention on the same keys."""

import math

import torch

from pagellm.model.attention import build_attention_metadata, paged_attention

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int) -> torch.Tensor:
    """q [Q, H, D] at positions context.., k/v [context + Q, KVH, D]."""
    group = HEADS // KV_HEADS
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(DIM)
    q_pos = torch.arange(q.shape[0])[:, None] + context
    k_pos = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def test_mixed_decode_and_chunked_prefill_match_reference():
    torch.manual_seed(0)
    kv_cache = torch.zeros(2, KV_HEADS, 16, BLOCK, DIM)
    # (tokens already cached, new tokens this step, block table) per request
    requests = [(5, 1, [7, 2]), (0, 6, [3, 9]), (4, 3, [11, 0]), (9, 1, [1, 5, 14])]
    all_keys, all_values = [], []
    for cached, new, table in requests:
        keys = torch.randn(cached + new, KV_HEADS, DIM)
        values = torch.randn(cached + new, KV_HEADS, DIM)
        for pos in range(cached):
            block, offset = table[pos // BLOCK], pos % BLOCK
            kv_cache[0, :, block, offset], kv_cache[1, :, block, offset] = keys[pos], values[pos]
        all_keys.append(keys)
        all_values.append(values)
    slots = [table[pos // BLOCK] * BLOCK + pos % BLOCK
             for cached, new, table in requests for pos in range(cached, cached + new)]
    metadata = build_attention_metadata(
        [new for _, new, _ in requests], [cached + new for cached, new, _ in requests],
        [table for _, _, table in requests], torch.tensor(slots), BLOCK, torch.device("cpu"))
    assert [g.query_index.shape for g in metadata.groups] == [(2, 1), (2, 6)]
    queries = [torch.randn(new, HEADS, DIM) for _, new, _ in requests]
    new_keys = torch.cat([k[c:] for k, (c, _, _) in zip(all_keys, requests)])
    new_values = torch.cat([v[c:] for v, (c, _, _) in zip(all_values, requests)])
    out = paged_attention(torch.cat(queries), new_keys, new_values, kv_cache, metadata,
                          scale=DIM ** -0.5)
    expected = torch.cat([reference_attention(q, k, v, cached) for q, k, v, (cached, _, _)
                          in zip(queries, all_keys, all_values, requests)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    block, offset = divmod(slots[-1], BLOCK)
    torch.testing.assert_close(kv_cache[0, :, block, offset], new_keys[-1])
