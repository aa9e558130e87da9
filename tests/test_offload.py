"""The second KV tier: LRU pool, offload on eviction, prefix loads, swap preemption, config,
metrics, a shadow-KV fuzz of the scheduler and greedy equivalence on a tiny model."""

from __future__ import annotations

import argparse
import json
import logging
import random
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pagellm import LLM, SamplingParams
from pagellm.config import SchedulerConfig
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.offload import OffloadPool, SwapCostModel
from pagellm.core.sched_output import (
    KVTransferStats,
    ModelRunnerOutput,
    OffloadStats,
    SchedulerOutput,
    SchedulerStats,
)
from pagellm.core.scheduler import Scheduler
from pagellm.engine.arg_utils import EngineArgs
from pagellm.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from pagellm.metrics.stats import IterationStats
from pagellm.model.attention import BLOCK_DIM
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


TRANSFER_CONFIG = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"block_size": 64, "cpu_bytes_to_use": 10_000}}


def test_flags_and_kv_transfer_config():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--kv-transfer-config", json.dumps(TRANSFER_CONFIG), "--preemption-mode", "swap"]))
    assert args.cache_config().offload_bytes == 10_000
    assert args.scheduler_config().preemption_mode == "swap"
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--kv-offloading-size", "0.5", "--kv-offloading-path", "/tmp/kv.bin"]))
    assert (args.offload_bytes(), args.cache_config().offload_path) == (1 << 29, "/tmp/kv.bin")
    assert EngineArgs().offload_bytes() == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"kv_transfer_config": json.dumps({"kv_connector": "NixlConnector"})}, "not supported"),
    ({"kv_transfer_config": "{"}, "not valid JSON"),
    ({"kv_transfer_config": json.dumps({**TRANSFER_CONFIG, "kv_connector_extra_config": {
        "block_size": 24, "cpu_bytes_to_use": 1}})}, "multiple of the KV cache block_size"),
    ({"kv_transfer_config": json.dumps(TRANSFER_CONFIG), "kv_offloading_size": 1.0}, "not both"),
    ({"kv_offloading_path": "/tmp/kv.bin"}, "needs a size"),
    ({"kv_offloading_size": 0.0}, "must be positive"),
    ({"preemption_mode": "swap"}, "needs a second KV tier"),
    ({"preemption_mode": "sometimes"}, "preemption_mode must be one of"),
])
def test_bad_offload_settings_are_clear_errors(kwargs: dict, message: str):
    args = EngineArgs(**kwargs)
    with pytest.raises(ValueError, match=message):
        args.cache_config()
        args.scheduler_config()


def offload_stats(usage: float, **transfers) -> SchedulerStats:
    return SchedulerStats(1, 0, 0.5, 0, 0, 2, num_preemptions_swap=1, num_preemptions_recompute=1,
                          offload=OffloadStats(usage, 4096, KVTransferStats(**transfers)))


def test_prometheus_exports_the_offload_family():
    registry = CollectorRegistry()
    prometheus = PrometheusStatLogger("tiny", registry)
    prometheus.record(offload_stats(0.25, num_stores=1, stored_blocks=2, store_bytes=512,
                                    store_seconds=0.5), IterationStats())
    prometheus.record(offload_stats(0.5, num_stores=2, stored_blocks=3, store_bytes=768,
                                    store_seconds=0.75, num_loads=1, loaded_blocks=1,
                                    load_bytes=256, load_seconds=0.1), IterationStats())
    expected = {"cpu_cache_usage_perc": 0.5, "cpu_allocation_size": 4096, "store_bytes_total": 768,
                "store_time_total": 0.75, "load_bytes_total": 256, "load_time_total": 0.1,
                "store_size_count": 2, "store_size_sum": 768, "load_size_count": 1}
    assert {name: registry.get_sample_value(f"vllm:kv_offload_{name}", {"model_name": "tiny"})
            for name in expected} == pytest.approx(expected)
    for name in ("vllm:num_preemptions_swap_total", "vllm:num_preemptions_recompute_total"):
        assert registry.get_sample_value(name, {"model_name": "tiny"}) == 1


def test_the_stats_line_is_followed_by_kv_transfer_metrics(caplog: pytest.LogCaptureFixture):
    logging.getLogger("pagellm").addHandler(caplog.handler)
    try:
        stat_logger = LoggingStatLogger()
        stat_logger.record(offload_stats(0.25, num_stores=1, store_bytes=512, store_seconds=0.5),
                           IterationStats())
        stat_logger.log()
    finally:
        logging.getLogger("pagellm").removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("Engine 000: Avg prompt throughput")
    assert lines[1] == (
        "KV Transfer metrics: vllm:kv_offload_cpu_cache_usage_perc=0.25, "
        "vllm:kv_offload_store_bytes=512, vllm:kv_offload_store_time=0.5, "
        "vllm:kv_offload_store_size_count=1, vllm:kv_offload_load_bytes=0, "
        "vllm:kv_offload_load_time=0.0, vllm:kv_offload_load_size_count=0")


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
TIGHT = {"max_model_len": 80, "block_size": 4, "num_gpu_blocks_override": 24}


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 500) for _ in range(30)]
    return [system + [rng.randrange(3, 500) for _ in range(rng.randrange(3, 30))]
            for _ in range(10)]


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """In two waves, so that the second finds the first's prefixes evicted to tier 2."""
    outputs = []
    for wave in (prompts[:5], prompts[5:]):
        outputs += [o.outputs[0].token_ids for o in llm.generate(wave, GREEDY, use_tqdm=False)]
    scheduler = llm.engine.core.scheduler
    scheduler.check_integrity()
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.pool.num_blocks
    return outputs


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path) -> list[list[int]]:
    llm = LLM(str(tiny_llama_dir), dtype="float32", **TIGHT)
    return generate(llm, shared_prefix_prompts(0))


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_greedy_tokens_are_the_same_with_the_second_tier(tiny_llama_dir: Path, expected,
                                                         mode: str):
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_offloading_size=0.001,
              preemption_mode=mode, **TIGHT)
    assert generate(llm, shared_prefix_prompts(0)) == expected
    stats = llm.engine.core.scheduler.make_stats()
    assert stats.offload.transfers.stored_blocks > 0 and stats.offload.transfers.loaded_blocks > 0
    assert stats.num_preemptions > 0
    if mode == "recompute":  # every load is then a tier-2 prefix hit
        assert stats.num_preemptions_swap == 0
    if mode == "swap":
        assert stats.num_preemptions_swap == stats.num_preemptions


def test_the_runner_stores_before_it_loads_in_every_layer(tiny_llama_dir: Path):
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_offloading_size=0.001, **TIGHT)
    runner = llm.engine.core.runner
    for layer, (tier1, tier2) in enumerate(zip(runner.kv_caches, runner.offload_caches)):
        for block in range(tier1.shape[BLOCK_DIM]):
            tier1[:, :, block] = 100 * layer + block
        tier2[:, :, 2] = -100 * layer - 2
    # Block 3 is evicted (stored) and reused for a load in the same step, as in a prefix hit.
    output = runner.execute(SchedulerOutput(kv_stores=[(3, 3), (5, 0)], kv_loads=[(2, 3)]))
    for layer, (tier1, tier2) in enumerate(zip(runner.kv_caches, runner.offload_caches)):
        assert (tier2[:, :, 3] == 100 * layer + 3).all() and (tier2[:, :, 0] == 100 * layer + 5).all()
        assert (tier1[:, :, 3] == -100 * layer - 2).all() and (tier1[:, :, 5] == 100 * layer + 5).all()
    transfers, size = output.transfers, runner.block_bytes()
    assert replace(transfers, store_seconds=0.0, load_seconds=0.0) == KVTransferStats(
        num_stores=1, stored_blocks=2, store_bytes=2 * size, num_loads=1, loaded_blocks=1,
        load_bytes=size)
    assert transfers.store_seconds > 0 and transfers.load_seconds > 0


def test_a_memory_mapped_file_holds_the_second_tier(tiny_llama_dir: Path, expected,
                                                    tmp_path: Path):
    path = tmp_path / "kv-tier2.bin"
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_offloading_size=0.001,
              kv_offloading_path=str(path), preemption_mode="swap", **TIGHT)
    assert generate(llm, shared_prefix_prompts(0)) == expected
    offload = llm.engine.core.scheduler.kv.offload
    assert path.stat().st_size == offload.num_bytes
    assert llm.engine.core.scheduler.make_stats().offload.transfers.loaded_blocks > 0
