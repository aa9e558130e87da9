"""Paged attention against a plain per-request causal attention on the same keys."""

import math

import pytest
import torch

from pagellm.kernels import cpu_kernels_available
from pagellm.model import attention
from pagellm.model.attention import build_attention_metadata, paged_attention

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int) -> torch.Tensor:
    """q [Q, H, D] at positions context.., k/v [context + Q, KVH, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(q.shape[0])[:, None] + context
    k_pos = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


@pytest.fixture(params=["cpu-kernel", "torch-ops"])
def decode_path(request, monkeypatch):
    """Run a test once with the compiled decode kernel and once with the torch fallback."""
    if request.param == "cpu-kernel" and not cpu_kernels_available():
        pytest.skip("no C++ compiler: the CPU kernels could not be built")
    if request.param == "torch-ops":
        monkeypatch.setattr(attention, "use_cpu_kernels", lambda x: False)
    return request.param


def cache_requests(kv_cache: torch.Tensor, requests: list[tuple[int, int, list[int]]]):
    """Random keys/values for (cached, new, block table) requests, the cached ones written
    to the cache; -> (keys, values) per request, and the step's metadata."""
    _, kv_heads, _, block, dim = kv_cache.shape
    all_keys, all_values = [], []
    for cached, new, table in requests:
        keys = torch.randn(cached + new, kv_heads, dim)
        values = torch.randn(cached + new, kv_heads, dim)
        for pos in range(cached):
            slot, offset = table[pos // block], pos % block
            kv_cache[0, :, slot, offset], kv_cache[1, :, slot, offset] = keys[pos], values[pos]
        all_keys.append(keys)
        all_values.append(values)
    slots = [table[pos // block] * block + pos % block
             for cached, new, table in requests for pos in range(cached, cached + new)]
    metadata = build_attention_metadata(
        [new for _, new, _ in requests], [cached + new for cached, new, _ in requests],
        [table for _, _, table in requests], torch.tensor(slots), block, torch.device("cpu"))
    return all_keys, all_values, metadata


def attend_and_reference(kv_cache: torch.Tensor, requests: list[tuple[int, int, list[int]]],
                         heads: int):
    """paged_attention over one step of `requests` (see cache_requests), and the reference
    attention of each request; -> (out, expected, metadata, this step's keys)."""
    all_keys, all_values, metadata = cache_requests(kv_cache, requests)
    dim = kv_cache.shape[-1]
    queries = [torch.randn(new, heads, dim) for _, new, _ in requests]
    new_keys = torch.cat([k[c:] for k, (c, _, _) in zip(all_keys, requests)])
    new_values = torch.cat([v[c:] for v, (c, _, _) in zip(all_values, requests)])
    out = paged_attention(torch.cat(queries), new_keys, new_values, kv_cache, metadata,
                          scale=dim ** -0.5)
    expected = torch.cat([reference_attention(q, k, v, cached) for q, k, v, (cached, _, _)
                          in zip(queries, all_keys, all_values, requests)])
    return out, expected, metadata, new_keys


def test_mixed_decode_and_chunked_prefill_match_reference(decode_path):
    torch.manual_seed(0)
    kv_cache = torch.zeros(2, KV_HEADS, 16, BLOCK, DIM)
    # (tokens already cached, new tokens this step, block table) per request
    requests = [(5, 1, [7, 2]), (0, 6, [3, 9]), (4, 3, [11, 0]), (9, 1, [1, 5, 14])]
    out, expected, metadata, new_keys = attend_and_reference(kv_cache, requests, HEADS)
    assert [g.query_index.shape for g in metadata.groups] == [(2, 1), (2, 6)]
    assert [g.all_tokens_in_order for g in metadata.groups] == [False, False]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    block, offset = divmod(int(metadata.slot_mapping[-1]), BLOCK)
    torch.testing.assert_close(kv_cache[0, :, block, offset], new_keys[-1])


@pytest.mark.parametrize("dim", [64, 128])
def test_long_prompt_chunks_match_reference(decode_path, dim):
    """Chunks of many 32-token work items (a fresh prompt, one after a cached prefix that
    ends mid-block, one of a few tokens), 3 query heads per kv head, 16-token blocks."""
    torch.manual_seed(6)
    kv_cache = torch.zeros(2, 2, 40, 16, dim)
    blocks = torch.randperm(40).tolist()
    requests = [(0, 70, blocks[:5]), (37, 100, blocks[5:14]), (130, 2, blocks[14:23]),
                (12, 1, blocks[23:24])]
    out, expected, metadata, _ = attend_and_reference(kv_cache, requests, 6)
    assert [g.query_index.shape for g in metadata.groups] == [(1, 1), (3, 100)]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["bf16", "e4m3", "e5m2"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(HEADS, KV_HEADS, DIM), (6, 2, 64),
                                                      (9, 3, 128)])
def test_bf16_decode_attention_keeps_float32_accuracy(decode_path, heads, kv_heads, dim,
                                                      cache_dtype):
    """Sharp attention (large scores) in bf16 must match float32 math on the same inputs (the
    keys and values as the cache rounds them). Head sizes 64 and 128 take the kernel's
    compiled-size paths (and its bf16 dot-product instruction where the CPU has one, fp8
    keys widened to bf16 for it); 8 takes the generic one."""
    torch.manual_seed(3)
    num_reqs, length = 3, 40
    kv_cache = torch.zeros(2, kv_heads, 32, BLOCK, dim, dtype=cache_dtype)
    tables = [list(range(i * 10, i * 10 + 10))[::-1] for i in range(num_reqs)]
    keys = (torch.randn(num_reqs, length, kv_heads, dim) * 5 / math.sqrt(dim / DIM)).bfloat16()
    values = torch.randn(num_reqs, length, kv_heads, dim).bfloat16()
    for r, table in enumerate(tables):
        for pos in range(length - 1):
            kv_cache[0, :, table[pos // BLOCK], pos % BLOCK] = keys[r, pos]
            kv_cache[1, :, table[pos // BLOCK], pos % BLOCK] = values[r, pos]
    slots = torch.tensor([t[(length - 1) // BLOCK] * BLOCK + (length - 1) % BLOCK for t in tables])
    metadata = build_attention_metadata([1] * num_reqs, [length] * num_reqs, tables, slots, BLOCK,
                                        torch.device("cpu"))
    assert metadata.groups[0].all_tokens_in_order  # a decode-only step: no gather, no scatter
    query = (torch.randn(num_reqs, heads, dim) * 5).bfloat16()
    out = paged_attention(query, keys[:, -1], values[:, -1], kv_cache, metadata, dim ** -0.5)
    expected = torch.cat([reference_attention(query[r:r + 1].float(),
                                              keys[r].to(cache_dtype).float(),
                                              values[r].to(cache_dtype).float(), length - 1)
                          for r in range(num_reqs)])
    # With bf16 scores and probabilities this misses by 0.066; float32 math by 0.004 (the
    # rounding of the bf16 output).
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=0)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                         torch.float8_e5m2], ids=["bf16", "fp16", "e4m3", "e5m2"])
def test_float32_queries_over_a_narrower_cache_match_its_rounded_keys(decode_path, cache_dtype):
    """A float32 model with a bf16/fp16/fp8 KV cache: this step's keys and values are
    rounded once as they are stored, and attention reads every key as that rounded value,
    in float32, on both the decode kernel and the prefill path. The inputs span fp8's
    subnormals and, in e4m3, its saturation at 448."""
    torch.manual_seed(4)
    heads, kv_heads, dim, length = 9, 3, 64, 21
    kv_cache = torch.zeros(2, kv_heads, 16, BLOCK, dim, dtype=cache_dtype)
    table = [9, 4, 12, 1, 7, 3]
    magnitudes = torch.logspace(-9, 9, dim, base=2)  # 2^-9 (e4m3's smallest) .. 512
    keys = torch.randn(length, kv_heads, dim) * magnitudes / 64
    values = torch.randn(length, kv_heads, dim) * magnitudes
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)])
    largest = torch.finfo(cache_dtype).max
    rounded_keys, rounded_values = (t.clamp(-largest, largest).to(cache_dtype).float()
                                    for t in (keys, values))
    query = torch.randn(length, heads, dim)
    # the prompt but its last token as one chunked-prefill step, then one decode step
    steps = [(range(0, length - 1), [length - 1], 0), (range(length - 1, length), [1], length - 1)]
    for positions, query_lens, cached in steps:
        index = torch.tensor(list(positions))
        metadata = build_attention_metadata(query_lens, [positions.stop], [table], slots[index],
                                            BLOCK, torch.device("cpu"))
        out = paged_attention(query[index], keys[index], values[index], kv_cache, metadata,
                              dim ** -0.5)
        expected = reference_attention(query[index], rounded_keys[:positions.stop],
                                       rounded_values[:positions.stop], cached)
        assert out.dtype == torch.float32
        spread = rounded_values.abs().max()  # float32's rounding, relative to the largest value
        torch.testing.assert_close(out / spread, expected / spread, atol=1e-6, rtol=1e-5)
    block, offset = divmod(int(slots[-1]), BLOCK)
    assert torch.equal(kv_cache[1, :, block, offset].float(), rounded_values[-1])


def test_prompts_from_position_zero_attend_causally_without_a_mask():
    """A step of whole prompts (nothing cached) of different lengths: the group carries no
    mask and SDPA's is_causal gives each prompt's reference attention, padding aside."""
    torch.manual_seed(5)
    kv_cache = torch.zeros(2, KV_HEADS, 16, BLOCK, DIM)
    lengths, tables = [7, 2, 5], [[4, 9], [1], [12, 3]]
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK
                          for length, table in zip(lengths, tables) for p in range(length)])
    metadata = build_attention_metadata(lengths, lengths, tables, slots, BLOCK, torch.device("cpu"))
    assert [g.mask for g in metadata.groups] == [None]
    keys = [torch.randn(n, KV_HEADS, DIM) for n in lengths]
    values = [torch.randn(n, KV_HEADS, DIM) for n in lengths]
    queries = [torch.randn(n, HEADS, DIM) for n in lengths]
    out = paged_attention(torch.cat(queries), torch.cat(keys), torch.cat(values), kv_cache,
                          metadata, scale=DIM ** -0.5)
    expected = torch.cat([reference_attention(q, k, v, 0) for q, k, v in zip(queries, keys, values)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_kernels_available(), reason="needs the CPU kernels")
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_float16_queries_decode_as_their_float32_values_rounded_once(cache_dtype):
    """The decode kernel widens float16 queries and computes in float32: its float16 output is
    its float32 output for the same values, rounded to float16, to the bit."""
    from pagellm.kernels import paged_decode_attention

    torch.manual_seed(5)
    heads, kv_heads, dim, blocks, requests = 9, 3, 64, 16, 3
    kv_cache = torch.randn(2, kv_heads, blocks, BLOCK, dim).to(cache_dtype)
    tables = torch.randperm(blocks)[:requests * 5].view(requests, 5)
    seq_lens = torch.tensor([20, 7, 13])
    query = torch.randn(requests, heads, dim).half()
    out = paged_decode_attention(query, kv_cache, tables, seq_lens, dim ** -0.5)
    wide = paged_decode_attention(query.float(), kv_cache, tables, seq_lens, dim ** -0.5)
    assert out.dtype == torch.float16
    assert torch.equal(out, wide.half())
