"""Sliding-window layers in the paged KV cache (HybridKVCacheManager): the layer groups, exact
block ids as the window slides, prefix hits that need only the last window, the start-up
figures, and a tiny Gemma 3 whose outputs are identical with and without giving blocks back."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from test_models import reference_greedy
from tiny_models import VOCAB_SIZE
from transformers import AutoModelForCausalLM

from pagellm import LLM, SamplingParams
from pagellm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagellm.core.kv_layout import hybrid_layout
from pagellm.request import Request

SLIDING, FULL = "sliding_attention", "full_attention"
BLOCK, WINDOW = 4, 8
LAYOUT = hybrid_layout([SLIDING, FULL], WINDOW, 1024)  # group 0 full, group 1 sliding


def test_gemma3_270m_layers_make_one_full_and_five_sliding_groups_of_three() -> None:
    layout = hybrid_layout(([SLIDING] * 5 + [FULL]) * 3, 512, 32768)
    assert layout.windows == (0, 512, 512, 512, 512, 512)
    assert layout.layer_groups == (1, 1, 1, 2, 2, 0, 2, 3, 3, 3, 4, 0, 4, 4, 5, 5, 5, 0)
    assert layout.layer_tensors == (0, 1, 2, 0, 1, 0, 2, 0, 1, 2, 0, 1, 1, 2, 0, 1, 2, 2)
    assert layout.num_tensors == 3
    # 2,048 blocks of the global group, 161 of each local one (a 2,048-token chunk + window)
    assert layout.blocks_per_request(32768, 16, 2048) == 2048 + 5 * 161
    assert layout.max_tokens(2048 + 5 * 161, 16, 2048) == 32768


def test_models_without_both_kinds_or_with_a_window_past_the_context_keep_one_group() -> None:
    assert hybrid_layout([FULL] * 4, 512, 32768) is None
    assert hybrid_layout([SLIDING, FULL], 512, 512) is None
    assert hybrid_layout(None, None, 32768) is None


def make_request(request_id: str, tokens: list[int], manager: HybridKVCacheManager) -> Request:
    request = Request(request_id, list(tokens), SamplingParams(), max_tokens=64)
    manager.hash_new_blocks(request)
    return request


def run(manager: HybridKVCacheManager, request: Request, num_tokens: int,
        computed_blocks: list[int] | None = None, holders: tuple[Request, ...] = ()) -> None:
    """Schedule `num_tokens` of `request` as the scheduler does, compute them, and append a
    sampled token once it is caught up; the pool checks out with `holders` holding blocks too."""
    computed_blocks = computed_blocks or []
    assert manager.can_allocate(request, num_tokens, computed_blocks)
    manager.allocate_slots(request, num_tokens, computed_blocks)
    request.num_computed_tokens += num_tokens
    if request.num_computed_tokens == request.num_tokens:
        request.append_output_token(7)
        manager.hash_new_blocks(request)
    manager.check_integrity([request, *holders])


def test_blocks_that_leave_the_window_go_back_and_are_reused() -> None:
    """Block 0 is the null block. Nine blocks hold a 17-token request only because the
    sliding group gives back blocks 4 and 5 as the window passes them (each at the step
    whose first query no longer sees it: position 11 sees keys 4.., position 15 keys 8..)."""
    manager = HybridKVCacheManager(9, BLOCK, LAYOUT)
    request = make_request("a", list(range(100, 110)), manager)
    run(manager, request, 10)
    assert (request.block_ids, request.group_block_ids) == ([1, 2, 3], [[4, 5, 6]])
    run(manager, request, 1)  # position 10 still sees key 3
    assert request.group_block_ids == [[4, 5, 6]]
    run(manager, request, 1)
    assert request.group_block_ids == [[0, 5, 6]]
    assert manager.pool.free_queue() == [7, 8, 4]
    run(manager, request, 1)  # position 12 starts block 3 in each group
    assert (request.block_ids, request.group_block_ids) == ([1, 2, 3, 7], [[0, 5, 6, 8]])
    for _ in range(3):
        run(manager, request, 1)
    assert request.group_block_ids == [[0, 0, 6, 8]]
    run(manager, request, 1)  # position 16: block 4, from the blocks given back
    assert (request.block_ids, request.group_block_ids) == ([1, 2, 3, 7, 4], [[0, 0, 6, 8, 5]])
    assert manager.pool.num_free_blocks == 0
    manager.free(request)
    manager.check_integrity([])
    assert manager.pool.num_free_blocks == 8


def finished_request(manager: HybridKVCacheManager) -> Request:
    """A request of a 30-token prompt decoded to 40 computed tokens, then freed: its sliding
    group gave back blocks 9..16 on the way (still cached), then everything went back."""
    request = make_request("a", list(range(200, 230)), manager)
    run(manager, request, 30)
    while request.num_computed_tokens < 40:
        run(manager, request, 1)
    assert request.block_ids == [1, 2, 3, 4, 5, 6, 7, 8, 17, 19]
    assert request.group_block_ids == [[0] * 8 + [18, 20]]
    manager.free(request)
    return request


def test_a_prefix_hit_takes_the_full_groups_blocks_and_the_sliding_ones_last_window() -> None:
    manager = HybridKVCacheManager(64, BLOCK, LAYOUT)
    finished = finished_request(manager)
    again = make_request("b", finished.prompt_token_ids, manager)
    hits = manager.get_computed_blocks(again)
    assert hits == [1, 2, 3, 4, 5, 6, 7]  # positions 28 and 29 are computed again
    run(manager, again, 2, hits)
    assert again.block_ids == [1, 2, 3, 4, 5, 6, 7, 21]
    assert again.group_block_ids == [[0, 0, 0, 0, 0, 14, 15, 22]]  # keys 21.. of the window


def test_no_hit_where_the_sliding_groups_window_was_evicted() -> None:
    """Another request's 100 tokens take the free blocks from the front, the given-back
    sliding blocks 9..15 among them: the 30-token prompt's global blocks are still cached,
    but not its window, so it gets no hit at all; the 41-token one's window (18, 20) was kept."""
    manager = HybridKVCacheManager(64, BLOCK, LAYOUT)
    finished = finished_request(manager)
    other = make_request("other", list(range(1000, 1100)), manager)
    run(manager, other, 100)
    assert 15 in other.group_block_ids[0] and 16 not in other.block_ids + other.group_block_ids[0]
    assert manager.get_computed_blocks(make_request("b", finished.prompt_token_ids, manager)) == []
    manager.free(other)
    longer = make_request("c", finished.all_token_ids, manager)
    hits = manager.get_computed_blocks(longer)
    assert hits == [1, 2, 3, 4, 5, 6, 7, 8, 17, 19]
    run(manager, longer, 1, hits)
    assert longer.group_block_ids[0][:10] == [0] * 8 + [18, 20]


def test_a_fork_shares_the_prompt_blocks_unless_a_local_group_gave_one_back() -> None:
    """With a window of 6: a 30-token prompt prefilled at once still holds every block when
    its second sample forks, so the child shares 7 blocks in each group (recomputing 28, 29);
    prefilled as 29 + 1, the last chunk's query at 29 sees keys 24.. only, block 5 went back,
    and the child's first query (28) would see it: the child shares nothing."""
    manager = HybridKVCacheManager(40, BLOCK, hybrid_layout([SLIDING, FULL], 6, 1024))
    parent = make_request("p", list(range(300, 330)), manager)
    run(manager, parent, 30)
    child = Request("p-1", parent.prompt_token_ids, SamplingParams(), max_tokens=64)
    manager.fork(parent, child)
    assert (child.block_ids, child.group_block_ids) == ([1, 2, 3, 4, 5, 6, 7],
                                                        [[9, 10, 11, 12, 13, 14, 15]])
    assert child.num_computed_tokens == 28
    chunked = make_request("q", list(range(400, 430)), manager)
    run(manager, chunked, 29, holders=(parent, child))
    run(manager, chunked, 1, holders=(parent, child))
    assert chunked.group_block_ids == [[0, 0, 0, 0, 0, 0, 31, 32]]
    late = Request("q-1", chunked.prompt_token_ids, SamplingParams(), max_tokens=64)
    manager.fork(chunked, late)
    assert (late.block_ids, late.group_block_ids, late.num_computed_tokens) == ([], [[]], 0)
    manager.check_integrity([parent, child, chunked, late])


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


# fp32, 2 KV heads of 16: a block of 4 tokens is 1 KiB a layer, 6 KiB for the six layers
ENGINE = dict(dtype="float32", block_size=BLOCK, max_model_len=256, max_num_batched_tokens=32,
              kv_cache_memory=500 * 6 * 1024)


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tiny_model_factory: Callable[[str], Path]) -> Path:
    return tiny_model_factory("gemma3_text")


@pytest.fixture(scope="module")
def engines(tiny_gemma3_dir: Path) -> Iterator[dict[bool, tuple[LLM, list[str]]]]:
    """The tiny Gemma 3 (a window of 8, five local layers and a global one), releasing
    blocks and keeping them, each with its start-up lines."""
    made = {}
    logger = logging.getLogger("pagellm")
    for release in (True, False):
        handler = Lines()
        logger.addHandler(handler)
        try:
            made[release] = (LLM(str(tiny_gemma3_dir), **ENGINE,
                                 disable_hybrid_kv_cache_manager=not release), handler.lines)
        finally:
            logger.removeHandler(handler)
    yield made


def test_maximum_concurrency_counts_the_sliding_groups_window_only(engines) -> None:
    """Kept: 500 blocks of six layers, 64 a request. Released: 3,000 blocks of one layer, the
    null block aside; a request holds 64 global ones and 5 x 11 local ones."""
    # On CUDA the size line starts with "GPU ", as vLLM's does.
    kept, released = ([line.removeprefix("GPU ") for line in engines[release][1]]
                      for release in (False, True))
    assert "Maximum concurrency for 256 tokens per request: 7.81x" in kept
    assert "KV cache size: 2,000 tokens" in kept
    assert "Maximum concurrency for 256 tokens per request: 25.20x" in released
    assert ("KV cache size: 1,996 tokens (11,776 in one request: sliding-window layers keep "
            "their window only)") in released
    assert isinstance(engines[True][0].engine.core.scheduler.kv, HybridKVCacheManager)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(length)] for length in (5, 37, 70)]


def test_outputs_are_identical_with_and_without_block_release(engines) -> None:
    """Greedy tokens and every step's top logprobs, exactly, over 40 steps past the window;
    then again from the prefixes cached (the released engine's from the global blocks and
    the local ones of the last window)."""
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=5, ignore_eos=True)
    results = {}
    for release, (llm, _) in engines.items():
        outputs = [o for _ in range(2) for o in llm.generate(prompts(), params, use_tqdm=False)]
        results[release] = [(o.outputs[0].token_ids,
                             [sorted(step.items()) for step in o.outputs[0].logprobs])
                            for o in outputs]
    assert results[True] == results[False]
    hits = [llm.engine.core.scheduler.kv.prefix_hits for llm, _ in engines.values()]
    assert hits[0] == hits[1] == (1 + 9 + 17) * BLOCK  # all but each prompt's last token


def test_a_long_generation_holds_the_window_only_and_matches_transformers(engines,
                                                                          tiny_gemma3_dir) -> None:
    """Step by step: each local group's table holds at most 10 live blocks (a 32-token chunk
    and the window before it), the pool checks out at every step, and the greedy tokens are
    transformers'."""
    core = engines[True][0].engine.core
    prompt = prompts(seed=1)[2]
    request = Request("long", prompt, SamplingParams(temperature=0.0, ignore_eos=True),
                      max_tokens=48)
    core.add_request(request)
    most_held = 0
    while core.has_unfinished_requests():
        core.step()
        core.scheduler.check_integrity()
        for table in request.group_block_ids:
            most_held = max(most_held, sum(1 for block in table if block))
    # the chunk of positions 32..63 and the 7 keys before it: blocks 6..15
    assert most_held == 10 and len(request.block_ids) == 0  # all freed at the end
    ref = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32).eval()
    expected = reference_greedy(ref, prompt, 48)
    assert request.output_token_ids[:len(expected)] == expected
