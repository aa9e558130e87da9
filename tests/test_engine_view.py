"""The engine view's data: the block map from the pools, the recorder's history, and
`/engine/stats` and the page's routes on a real server (with and without an API key)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagellm import LLM, SamplingParams
from pagellm.core.block_map import CACHED, FREE, OFFLOADED, USED, block_map
from pagellm.core.block_pool import BlockPool
from pagellm.core.offload import OffloadPool
from pagellm.core.sched_output import SchedulerStats
from pagellm.entrypoints.openai.frontend import ready_line
from pagellm.metrics.engine_view import EngineViewRecorder
from pagellm.metrics.stats import IterationStats
from server_utils import RemoteServer, assert_clean_shutdown


def _pool_with_states() -> BlockPool:
    """Blocks 0-2 used, 3-4 cached (freed with a hash), the rest free."""
    pool = BlockPool(10)
    blocks = pool.get_new_blocks(5)
    pool.cache_block(blocks[3], b"a")
    pool.cache_block(blocks[4], b"b")
    pool.free_blocks(blocks[3:])
    return pool


def test_block_map_states_and_counts() -> None:
    pool = _pool_with_states()
    offload = OffloadPool(4, block_bytes=64)
    offload.store(b"a")
    picture = block_map(pool, offload)
    assert list(picture.tier1.cells) == [USED] * 3 + [CACHED] * 2 + [FREE] * 5
    assert picture.tier1.counts == {FREE: 5, USED: 3, CACHED: 2}
    assert list(picture.tier2.cells) == [OFFLOADED, FREE, FREE, FREE]
    assert block_map(pool, None).tier2 is None


def test_big_cache_is_drawn_in_cells_of_the_majority_state() -> None:
    pool = BlockPool(1000)
    pool.get_new_blocks(300)
    picture = block_map(pool, None, max_cells=100)
    assert picture.tier1.blocks_per_cell == 10 and len(picture.tier1.cells) == 100
    assert list(picture.tier1.cells) == [USED] * 30 + [FREE] * 70
    assert picture.tier1.counts[USED] == 300  # the counts stay exact


def test_engine_core_maps_its_blocks_at_the_first_step_and_when_idle(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    engine = llm.engine
    assert engine.info.num_kv_blocks == 64
    engine.add_request("a", {"prompt_token_ids": list(range(3, 40))},
                       SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    first = engine.last_stats.block_map
    assert first is not None and first.tier1.counts[USED] == 3  # 37 tokens in blocks of 16
    maps = []
    while engine.has_unfinished_requests():
        engine.step()
        maps.append(engine.last_stats.block_map)
    assert maps[-1] is not None  # idle: a fresh map, nothing held any more
    assert maps[-1].tier1.counts[USED] == 0 and maps[-1].tier1.counts[CACHED] == 2


def _stats(running: int, prompt: int, queries: int, hits: int) -> SchedulerStats:
    return SchedulerStats(num_running=running, num_waiting=1, kv_cache_usage=0.25,
                          num_prompt_tokens=prompt, num_generation_tokens=0, num_preemptions=2,
                          prefix_cache_queries=queries, prefix_cache_hits=hits,
                          num_preemptions_swap=1, num_preemptions_recompute=1)


def test_recorder_snapshot() -> None:
    recorder = EngineViewRecorder(num_blocks=8, bucket_seconds=3600)
    empty = recorder.snapshot()
    assert empty["running"] == 0 and empty["blocks"]["counts"] == {"free": 8, "used": 0,
                                                                   "cached": 0}
    stats = _stats(running=3, prompt=40, queries=40, hits=0)
    stats.block_map = block_map(_pool_with_states(), None)
    recorder.record(stats, IterationStats(num_generation_tokens=5))
    recorder.record(_stats(running=2, prompt=10, queries=80, hits=30), IterationStats(7))
    snapshot = recorder.snapshot()
    assert (snapshot["running"], snapshot["waiting"]) == (2, 1)
    assert snapshot["prefix_cache"]["hit_rate"] == pytest.approx(30 / 80)
    assert snapshot["prefix_cache"]["recent_hit_rate"] == pytest.approx(30 / 80)
    assert snapshot["preemptions"] == {"total": 2, "swap": 1, "recompute": 1}
    assert snapshot["blocks"]["cells"] == "1112200000"  # the last map, kept between maps
    [bucket] = snapshot["throughput"]["series"]
    assert bucket["prompt"] > 0 and bucket["generation"] / bucket["prompt"] == pytest.approx(0.24)


def test_ready_line_names_browser_and_sdk_urls() -> None:
    line = ready_line("127.0.0.1", 8000, frontend=True)
    assert "open http://127.0.0.1:8000/ in a browser" in line
    assert 'base_url="http://127.0.0.1:8000/v1"' in line
    assert "browser" not in ready_line("127.0.0.1", 8000, frontend=False)


@pytest.fixture(scope="module")
def keyed_server(tiny_llama_dir: Path) -> Iterator[RemoteServer]:
    remote = RemoteServer(tiny_llama_dir, "--served-model-name", "tiny", api_key="sk-view")
    yield remote
    assert_clean_shutdown(remote.stop())


def test_page_is_open_but_its_data_needs_the_key(keyed_server: RemoteServer) -> None:
    page = httpx.get(f"{keyed_server.url}/")
    assert page.status_code == 200 and "engine view" in page.text
    script = httpx.get(f"{keyed_server.url}/static/chat.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    denied = httpx.get(f"{keyed_server.url}/engine/stats")
    assert denied.status_code == 401 and denied.json()["error"]["code"] == 401
    assert httpx.get(f"{keyed_server.url}/static/missing.js").status_code == 401

    keyed_server.client().completions.create(model="tiny", prompt="Hello there", max_tokens=4)
    stats = httpx.get(f"{keyed_server.url}/engine/stats", headers=keyed_server.headers()).json()
    assert stats["model"] == "tiny" and stats["running"] == 0
    assert stats["blocks"]["num_blocks"] == 512
    assert stats["prefix_cache"]["queries"] > 0
    assert sum(point["generation"] for point in stats["throughput"]["series"]) > 0
    assert "pagellm is ready: open http://127.0.0.1:" in keyed_server.output()


def test_disable_frontend(tiny_llama_dir: Path) -> None:
    remote = RemoteServer(tiny_llama_dir, "--disable-frontend")
    try:
        assert httpx.get(f"{remote.url}/").status_code == 404
        assert httpx.get(f"{remote.url}/engine/stats").status_code == 200
    finally:
        output = remote.stop()
    assert_clean_shutdown(output)
    assert "in a browser" not in output and "point an OpenAI SDK" in output
