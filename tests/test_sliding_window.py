"""Sliding-window attention (Gemma 3's local layers) on every attention path."""

import math

import pytest
import torch
from test_attention import decode_path  # noqa: F401  (a fixture)

from pagellm.kernels import prefill_attention_available
from pagellm.model.attention import build_attention_metadata, paged_attention

HEADS, KV_HEADS, BLOCK = 6, 2, 4


def windowed_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int,
                       window: int) -> torch.Tensor:
    """q [Q, H, D] at positions context.. over k/v [context + Q, KVH, D]: each query sees the
    keys at its position and the window - 1 before it."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    delta = (torch.arange(q.shape[0])[:, None] + context) - torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill((delta < 0) | (delta >= window), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


# (tokens cached, new tokens, block table): decodes whose window starts mid-block, on a block
# edge and before the first key; a fresh prompt longer than the window; a chunk after a prefix
REQUESTS = [(13, 1, [7, 2, 30, 5]), (16, 1, [1, 9, 3, 11, 25]), (2, 1, [14]),
            (0, 45, [4, 8, 12, 0, 6, 10, 15, 17, 19, 21, 23, 26]),
            (21, 40, [27, 28, 29, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43])]


def attend(requests, window: int, dim: int, batch_invariant: bool = False, seed: int = 0):
    """One step of `requests` over random keys, values and queries drawn from `seed` (the same
    tensors for a request whatever else the step holds) -> (out, reference)."""
    kv_cache = torch.zeros(2, KV_HEADS, 48, BLOCK, dim)
    generator = torch.Generator().manual_seed(seed)
    longest = 64  # drawn alike for every step
    keys, values = (torch.randn(longest, KV_HEADS, dim, generator=generator) for _ in range(2))
    queries = torch.randn(longest, HEADS, dim, generator=generator)
    slots, outs, expected = [], [], []
    for cached, new, table in requests:
        for pos in range(cached):
            block, offset = table[pos // BLOCK], pos % BLOCK
            kv_cache[0, :, block, offset], kv_cache[1, :, block, offset] = keys[pos], values[pos]
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, cached + new)]
        end = cached + new
        expected.append(windowed_reference(queries[cached:end], keys[:end], values[:end], cached,
                                           window))
    metadata = build_attention_metadata(
        [n for _, n, _ in requests], [c + n for c, n, _ in requests],
        [t for _, _, t in requests], torch.tensor(slots), BLOCK, torch.device("cpu"),
        batch_invariant=batch_invariant)
    pick = lambda t: torch.cat([t[c:c + n] for c, n, _ in requests])  # noqa: E731
    out = paged_attention(pick(queries), pick(keys), pick(values), kv_cache, metadata,
                          scale=dim ** -0.5, window=window)
    return out, torch.cat(expected)


@pytest.mark.parametrize("dim", [8, 64])
@pytest.mark.parametrize("window", [5, 8, 17])
def test_windowed_decode_and_prefill_match_reference(decode_path, window, dim):  # noqa: F811
    out, expected = attend(REQUESTS, window, dim)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not prefill_attention_available(), reason="no prefill kernel here")
@pytest.mark.parametrize("window", [5, 8, 17])
def test_batch_invariant_window_matches_reference_and_is_invariant(window):
    """One group through the prefill kernel: right, and each row bit-identical whether it
    shares its work item with a chunk's other rows or is attended alone."""
    out, expected = attend(REQUESTS, window, 64, batch_invariant=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    cached, new, table = REQUESTS[3]
    for last in (new - 1, 20, 9):  # the chunk's row `last`, as a decode of the same request
        alone, _ = attend([(last, 1, table)], window, 64, batch_invariant=True)
        whole, _ = attend([(cached, new, table)], window, 64, batch_invariant=True)
        assert torch.equal(alone[0], whole[last])


def test_window_wider_than_the_context_is_plain_causal_attention(decode_path):  # noqa: F811
    wide, expected = attend(REQUESTS, 1000, 8)
    torch.testing.assert_close(wide, expected, atol=1e-5, rtol=1e-5)
