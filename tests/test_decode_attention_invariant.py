"""paged_decode_attention_invariant against paged_prefill_attention: bit-identical rows.

The batch-invariant engine sends decode-only steps to the decode kernel and every other step
to the prefill kernel, so a token's attention must come out bit for bit the same from the
decode kernel, from the prefill kernel as a lone query, and as the last row of a chunk.
`torch.equal`, never a tolerance: one differing bit is a broken invariance.
"""

import pytest
import torch

from pagellm.kernels import (decode_attention_invariant_available, paged_decode_attention_invariant,
                             paged_prefill_attention)

pytestmark = pytest.mark.skipif(
    not decode_attention_invariant_available(),
    reason="the CPU kernels (AVX2 and FMA) could not be built")

LENGTHS = [1, 15, 16, 17, 100, 1000]
KV_HEADS = 2
CACHE_DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
                torch.float32]


def random_case(lengths: list[int], group: int, dim: int, block: int, cache_dtype: torch.dtype,
                query_dtype: torch.dtype, chunk: int, seed: int):
    """A cache holding every request's keys in blocks scattered at random, and each request's
    last `chunk` queries (fewer where it has fewer tokens)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block) for n in lengths]
    num_blocks = 2 * sum(blocks) + 3
    cache = torch.randn(2, KV_HEADS, num_blocks, block, dim, generator=gen).to(cache_dtype)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int64)
    used = 0
    for n, count in enumerate(blocks):
        tables[n, :count] = order[used:used + count]
        used += count
    chunks = [torch.randn(min(chunk, n), KV_HEADS * group, dim, generator=gen).to(query_dtype)
              for n in lengths]
    return cache, tables, torch.tensor(lengths, dtype=torch.int64), chunks


def prefill(chunks, cache, tables, seq_lens, scale, window):
    """The prefill kernel over each request's chunk -> the row of each chunk's last token."""
    lens = torch.tensor([c.shape[0] for c in chunks], dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    out = paged_prefill_attention(torch.cat(chunks), cache, tables, seq_lens, starts, lens,
                                  int(lens.sum()), scale, window)
    return out[starts + lens - 1]


def check(lengths, group, dim, block, cache_dtype, query_dtype, window, seed=0):
    cache, tables, seq_lens, chunks = random_case(lengths, group, dim, block, cache_dtype,
                                                  query_dtype, 40, seed)
    scale = dim ** -0.5
    last = [c[-1:] for c in chunks]
    alone = prefill(last, cache, tables, seq_lens, scale, window)
    in_chunk = prefill(chunks, cache, tables, seq_lens, scale, window)
    shorter = prefill([c[-5:] for c in chunks], cache, tables, seq_lens, scale, window)
    decoded = paged_decode_attention_invariant(torch.cat(last), cache, tables, seq_lens, scale,
                                               window)
    assert torch.isfinite(decoded.float()).all()
    assert torch.equal(alone, in_chunk) and torch.equal(alone, shorter)  # the premise
    assert torch.equal(decoded, alone)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group,dim", [(1, 64), (3, 64), (4, 128), (8, 64), (3, 128)])
@pytest.mark.parametrize("window", [0, 7, 32])
def test_decode_rows_equal_the_prefill_kernels(cache_dtype, query_dtype, group, dim, window):
    check(LENGTHS, group, dim, 16, cache_dtype, query_dtype, window)


@pytest.mark.parametrize("block", [8, 32, 48])
@pytest.mark.parametrize("window", [0, 20])
def test_other_block_sizes(block, window):
    check(LENGTHS, 3, 64, block, torch.bfloat16, torch.float32, window, seed=1)


@pytest.mark.parametrize("length", LENGTHS)
def test_each_length_alone_equals_it_in_a_batch(length):
    """A request's row does not depend on the others in the call, nor on the pool's split."""
    cache, tables, seq_lens, chunks = random_case(LENGTHS, 3, 64, 16, torch.bfloat16,
                                                  torch.bfloat16, 1, 2)
    everyone = paged_decode_attention_invariant(torch.cat(chunks), cache, tables, seq_lens, 0.125)
    n = LENGTHS.index(length)
    alone = paged_decode_attention_invariant(chunks[n], cache, tables[n:n + 1],
                                             seq_lens[n:n + 1], 0.125)
    assert torch.equal(everyone[n:n + 1], alone)


def test_rows_do_not_depend_on_how_many_threads_share_them(on_one_thread):
    """Each thread requests the blocks of its next (request, kv head) item ahead, wherever its
    range of items ends: one thread, then the pool (twice), give the same bits."""
    cache, tables, seq_lens, chunks = random_case(LENGTHS * 8, 3, 64, 16, torch.bfloat16,
                                                  torch.float32, 1, 4)
    query = torch.cat(chunks)
    alone = on_one_thread(paged_decode_attention_invariant, query, cache, tables, seq_lens,
                          0.125)
    for _ in range(2):
        assert torch.equal(paged_decode_attention_invariant(query, cache, tables, seq_lens,
                                                            0.125), alone)


def test_query_rows_with_a_stride():
    """Queries as the engine hands them: a view of the fused q/k/v projection's rows."""
    cache, tables, seq_lens, chunks = random_case(LENGTHS, 3, 64, 16, torch.bfloat16,
                                                  torch.float32, 1, 3)
    query = torch.cat(chunks)
    fused = torch.randn(query.shape[0], query.shape[1] + 2 * KV_HEADS, 64)
    fused[:, :query.shape[1]] = query
    strided = fused[:, :query.shape[1]]
    assert not strided.is_contiguous()
    decoded = paged_decode_attention_invariant(strided, cache, tables, seq_lens, 0.125, 7)
    assert torch.equal(decoded, prefill(chunks, cache, tables, seq_lens, 0.125, 7))
