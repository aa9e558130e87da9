"""The second KV tier from the outside: flags and kv-transfer-config, metrics and the log
line, and greedy equivalence on a tiny model with the tier on and off."""

from __future__ import annotations

import argparse
import json
import logging
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from pagellm import LLM, SamplingParams
from pagellm.core.sched_output import (
    KVTransferStats,
    OffloadStats,
    SchedulerOutput,
    SchedulerStats,
)
from pagellm.engine.arg_utils import EngineArgs
from pagellm.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from pagellm.metrics.stats import IterationStats
from pagellm.model.attention import BLOCK_DIM

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
    assert {name: registry.get_sample_value(f"vllm:kv_offload_{name}", {"model_name": "tiny", "engine": "0"})
            for name in expected} == pytest.approx(expected)
    for name in ("vllm:num_preemptions_swap_total", "vllm:num_preemptions_recompute_total"):
        assert registry.get_sample_value(name, {"model_name": "tiny", "engine": "0"}) == 1


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


def test_an_fp8_cache_swaps_through_the_second_tier_byte_for_byte(tiny_llama_dir: Path):
    """fp8 blocks travel between the tiers as bytes (torch has no fp8 copy kernels): the
    greedy tokens are those of the same fp8 cache without a second tier."""
    fp8 = {"dtype": "float32", "kv_cache_dtype": "fp8", **TIGHT}
    prompts = shared_prefix_prompts(1)
    expected = generate(LLM(str(tiny_llama_dir), **fp8), prompts)
    llm = LLM(str(tiny_llama_dir), kv_offloading_size=0.001, preemption_mode="swap", **fp8)
    assert llm.engine.core.runner.offload_caches[0].dtype == torch.float8_e4m3fn
    assert generate(llm, prompts) == expected
    stats = llm.engine.core.scheduler.make_stats()
    assert stats.num_preemptions_swap > 0 and stats.offload.transfers.loaded_blocks > 0
