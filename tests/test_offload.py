"""The second KV tier inside the scheduler: LRU pool, offload on eviction, prefix loads,
swap preemption, the cost model and a shadow-KV fuzz of the scheduler."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from pagellm import SamplingParams
from pagellm.config import SchedulerConfig
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.offload import OffloadPool, SwapCostModel
from pagellm.core.sched_output import (
    ModelRunnerOutput,
    SchedulerOutput,
)
from pagellm.core.scheduler import Scheduler
from pagellm.request import Request, RequestStatus

BLOCK = 4
H = [bytes([i]) * 16 for i in range(8)]  # stand-in prefix hashes


def make_scheduler(num_blocks: int, offload_blocks: int, mode: str = "auto",
                   caching: bool = True, swap_cost: SwapCostModel | None = None) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                             preemption_mode=mode)
    offload = OffloadPool(offload_blocks, block_bytes=100)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK, caching, offload), swap_cost)


def make_request(request_id: str, tokens: list[int], max_tokens: int = 8, n: int = 1) -> Request:
    return Request(request_id, list(tokens), SamplingParams(n=n), max_tokens=max_tokens)


def step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    sampled = {s.request.request_id: [1] * s.num_samples for s in output.scheduled if s.samples}
    scheduler.update_from_output(output, ModelRunnerOutput(sampled=sampled))
    scheduler.check_integrity()
    return output


def prefill_and_finish(scheduler: Scheduler, request: Request) -> SchedulerOutput:
    scheduler.add_request(request)
    output = step(scheduler)
    scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
    scheduler.check_integrity()
    return output


def test_offload_pool_fills_empty_blocks_first_then_evicts_lru():
    pool = OffloadPool(3, block_bytes=100)
    assert [pool.store(H[0]), pool.store(H[1])] == [0, 1]
    pool.release([0, 1])
    assert pool.lru_order() == [0, 1] and pool.usage() == pytest.approx(2 / 3)
    assert pool.store(H[0]) is None  # here already: it becomes the most recently used
    assert pool.lru_order() == [1, 0]
    assert pool.store(H[2]) == 2  # the empty block goes before any eviction
    pool.release([2])
    assert pool.store(H[3]) == 1  # H[1] was least recently used
    assert (pool.lookup(H[1]), pool.lookup(H[3]), pool.num_evictions) == (None, 1, 1)
    pool.release([1])
    assert pool.lru_order() == [0, 2, 1]
    pool.check_integrity()


def test_offload_pool_never_evicts_held_blocks():
    pool = OffloadPool(2, block_bytes=100)
    swapped = pool.allocate(1)
    assert swapped == [0] and pool.store(H[0]) == 1
    assert pool.store(H[1]) is None and pool.num_free_blocks == 0  # both held: dropped
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.release([1])
    pool.hold([1])  # a load source this step
    assert pool.store(H[2]) is None
    pool.release([1])
    pool.check_integrity([swapped])
    pool.release(swapped)
    assert pool.usage() == 0.5 and pool.lru_order() == [1]
    pool.check_integrity()


def test_tier1_evictions_become_stores_and_a_lost_prefix_is_loaded_back():
    scheduler = make_scheduler(num_blocks=4, offload_blocks=4)
    a = make_request("a", list(range(12)))
    prefill_and_finish(scheduler, a)
    assert scheduler.kv.pool.free_queue() == [3, 2, 1, 0]
    output = prefill_and_finish(scheduler, make_request("b", list(range(100, 108))))
    assert output.kv_stores == [(2, 0)]  # block 2 held a's third block
    output = prefill_and_finish(scheduler, make_request("c", list(range(200, 211))))
    assert output.kv_stores == [(1, 1), (0, 2), (2, 3)]  # a's second, a's first, b's second
    offload = scheduler.kv.offload
    assert [offload.lookup(h) for h in a.block_hashes] == [2, 1, 0]
    again = make_request("d", list(range(12)) + [50])
    scheduler.add_request(again)
    output = step(scheduler)
    # a's three blocks come back from tier 2 into the front of the free queue [3, 2, 0, 1].
    assert output.kv_loads == [(2, 3), (1, 2), (0, 0)]
    assert again.block_ids == [3, 2, 0, 1]
    assert (output.scheduled[0].start, output.scheduled[0].num_tokens) == (12, 1)
    assert [scheduler.kv.pool.get_cached_block(h) for h in a.block_hashes] == [3, 2, 0]
    # Evicting block 3 stores b's first block over b's second (tier-2 LRU); c's blocks 0 and 1
    # are dropped: the other tier-2 blocks are this step's load sources.
    assert output.kv_stores == [(3, 3)]
    assert offload.lru_order() == [3, 2, 1, 0]


def test_the_last_token_is_computed_even_when_tier2_has_the_whole_prompt():
    scheduler = make_scheduler(num_blocks=2, offload_blocks=4)
    prefill_and_finish(scheduler, make_request("a", list(range(8))))
    prefill_and_finish(scheduler, make_request("b", list(range(100, 108))))
    again = make_request("c", list(range(8)))
    scheduler.add_request(again)
    output = step(scheduler)
    assert len(output.kv_loads) == 1 and again.num_computed_tokens == 8
    assert (output.scheduled[0].start, output.scheduled[0].num_tokens) == (4, 4)


def test_can_allocate_counts_the_fresh_blocks_of_tier2_loads():
    manager = KVCacheManager(3, BLOCK, offload=OffloadPool(4, block_bytes=100))
    request = make_request("a", list(range(13)))
    manager.hash_new_blocks(request)
    stored = [manager.offload.store(block_hash) for block_hash in request.block_hashes[:2]]
    manager.offload.release(stored)
    offloaded = manager.get_offloaded_blocks(request, 0)
    assert offloaded == [0, 1]
    assert manager.can_allocate(request, 4, (), offloaded)  # 2 loads + 1 block for 9..12
    assert not manager.can_allocate(request, 5, (), offloaded)
    manager.allocate_slots(request, 5 - 1, (), offloaded)
    assert manager.take_transfers() == ([], [(0, 0), (1, 1)])
    manager.check_integrity([request])


def test_swap_preemption_keeps_the_computed_count_and_round_trips_the_blocks():
    scheduler = make_scheduler(num_blocks=3, offload_blocks=4, mode="swap", caching=False)
    scheduler.add_request(make_request("a", list(range(4)), max_tokens=2))
    scheduler.add_request(make_request("b", list(range(10, 14))))
    step(scheduler)  # a: [0], b: [1]
    output = step(scheduler)  # a takes block 2; b is swapped out; a finishes
    b = scheduler.requests["b"]
    assert [r.request_id for r in output.preempted] == ["b"]
    assert output.kv_stores == [(1, 0)] and not output.kv_loads
    assert (b.num_computed_tokens, b.block_ids, b.swapped_block_ids) == (4, [], [0])
    assert (scheduler.num_swaps, scheduler.num_recomputes) == (1, 0)
    output = step(scheduler)  # free queue: [1, 2, 0]
    assert output.kv_loads == [(0, 1)] and b.block_ids == [1, 2] and not b.swapped_block_ids
    assert (output.scheduled[0].start, output.scheduled[0].num_tokens) == (4, 1)
    assert scheduler.kv.offload.usage() == 0.0
    stats = scheduler.make_stats()
    assert (stats.num_preemptions, stats.num_preemptions_swap) == (1, 1)


def test_aborting_a_swapped_out_request_frees_its_tier2_blocks():
    scheduler = make_scheduler(num_blocks=3, offload_blocks=4, mode="swap", caching=False)
    scheduler.add_request(make_request("a", list(range(4))))
    scheduler.add_request(make_request("b", list(range(10, 14))))
    step(scheduler)
    step(scheduler)
    assert scheduler.requests["b"].swapped_block_ids == [0]
    scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    scheduler.check_integrity()
    assert scheduler.kv.offload.num_free_blocks == 4


def preempt_b(scheduler: Scheduler) -> Request:
    """a: [0], b: [1, 2]; then a takes block 3 and b, needing one more, is preempted."""
    scheduler.add_request(make_request("a", list(range(4))))
    scheduler.add_request(make_request("b", list(range(10, 18))))
    step(scheduler)
    step(scheduler)
    return scheduler.requests["b"]


def test_recompute_when_tier2_has_no_room_or_the_mode_says_so():
    for offload_blocks, mode in ((1, "swap"), (4, "recompute"), (4, "auto")):
        scheduler = make_scheduler(num_blocks=4, offload_blocks=offload_blocks, mode=mode,
                                   caching=False)
        b = preempt_b(scheduler)
        assert b.num_computed_tokens == 0 and not b.swapped_block_ids, mode
        assert (scheduler.num_swaps, scheduler.num_recomputes) == (0, 1)


COST = SwapCostModel(num_params=1_000_000, attention_width=1000, block_bytes=10_000,
                     flops_per_second=1e12, copy_latency=1e-3, copy_bytes_per_second=1e10)


def test_the_cost_model_swaps_long_contexts_and_recomputes_short_ones():
    assert COST.recompute_seconds(16) == pytest.approx((2e6 * 16 + 2e3 * 16 ** 2) / 1e12)
    assert COST.swap_seconds(1) == pytest.approx(2 * (1e-3 + 1e4 / 1e10))
    assert not COST.prefers_swap(16, 1)
    assert COST.prefers_swap(4096, 256)
    instant = replace(COST, copy_latency=0.0)  # then 8 tokens are worth a swap
    for cost, swapped in ((COST, False), (instant, True)):
        scheduler = make_scheduler(num_blocks=4, offload_blocks=4, caching=False, swap_cost=cost)
        assert bool(preempt_b(scheduler).swapped_block_ids) == swapped
        assert (scheduler.num_swaps, scheduler.num_recomputes) == (swapped, not swapped)


class ShadowRunner:
    """Plays the model runner with one tag per KV slot (the prefix it encodes), so that any
    wrong copy, lost store or premature reuse shows up as a wrong tag."""

    def __init__(self, scheduler: Scheduler) -> None:
        kv = scheduler.kv
        self.tier1 = [[None] * BLOCK for _ in range(kv.pool.num_blocks)]
        self.tier2 = [[None] * BLOCK for _ in range(kv.offload.num_blocks)]

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        assert len({t for _, t in output.kv_stores}) == len(output.kv_stores)
        assert len({t for _, t in output.kv_loads}) == len(output.kv_loads)
        for source, target in output.kv_stores:
            self.tier2[target] = list(self.tier1[source])
        for source, target in output.kv_loads:
            self.tier1[target] = list(self.tier2[source])
        sampled = {}
        for item in output.scheduled:
            request, end = item.request, item.start + item.num_tokens
            for pos in range(item.start, end):
                self.tier1[request.block_ids[pos // BLOCK]][pos % BLOCK] = self.tag(request, pos)
            for pos in range(end):
                assert self.tier1[request.block_ids[pos // BLOCK]][pos % BLOCK] == \
                    self.tag(request, pos), (request.request_id, pos)
            if item.samples:
                token = sum(request.all_token_ids[-3:]) * 31 % 97
                sampled[request.request_id] = [token] * item.num_samples
        return ModelRunnerOutput(sampled=sampled)

    @staticmethod
    def tag(request: Request, pos: int) -> tuple[int, ...]:
        return tuple(request.all_token_ids[:pos + 1])


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shadow_kv_stays_correct_under_random_load(mode: str, seed: int):
    rng = random.Random(seed)
    cost = SwapCostModel(100, 50, 1000, 1e9, 1e-6, 1e9)  # auto swaps from 8 tokens on
    scheduler = make_scheduler(num_blocks=14, offload_blocks=rng.choice([3, 8, 30]), mode=mode,
                               swap_cost=cost)
    scheduler.config.max_num_batched_tokens = 16
    runner = ShadowRunner(scheduler)
    prefixes = [[rng.randrange(100) for _ in range(rng.randrange(4, 16))] for _ in range(3)]
    for index in range(60):
        for _ in range(rng.choice([0, 0, 1, 2])):
            tail = [rng.randrange(100) for _ in range(rng.randrange(1, 8))]
            scheduler.add_request(make_request(f"r{index}-{rng.random()}",
                                               rng.choice(prefixes) + tail, rng.randrange(1, 20),
                                               n=rng.choice([1, 1, 1, 2])))
        if scheduler.requests and rng.random() < 0.05:
            scheduler.finish_requests([rng.choice(list(scheduler.requests))],
                                      RequestStatus.FINISHED_ABORTED)
        output = scheduler.schedule()
        scheduler.update_from_output(output, runner.execute(output))
        scheduler.check_integrity()
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        scheduler.update_from_output(output, runner.execute(output))
        scheduler.check_integrity()
    assert scheduler.num_preemptions > 0
