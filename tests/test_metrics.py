"""/metrics through prometheus-client's own parser: vLLM's names, labels, and counters that move."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import RemoteServer

PROMPT = list(range(10, 74))  # 64 token ids: four full blocks of 16


@pytest.fixture(scope="module")
def server(tiny_server: RemoteServer) -> RemoteServer:
    """The tiny llama as "tiny", shared with test_rag_service.py (shared_servers.py)."""
    return tiny_server


def scrape(server: RemoteServer) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} for every `vllm:` sample."""
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith("vllm:")}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"model_name": "tiny", "engine": "0", **labels}.items())))]


def complete(server: RemoteServer, max_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200
    return response.json()


def test_metric_names_and_types_follow_vllm(server: RemoteServer):
    complete(server, 2)
    names = {name for name, _ in scrape(server)}
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:kv_cache_usage_perc"):
        assert gauge in names
    for counter in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
                    "prompt_tokens", "generation_tokens", "request_success"):
        assert f"vllm:{counter}_total" in names
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                      "e2e_request_latency_seconds", "request_prompt_tokens",
                      "request_generation_tokens"):
        assert {f"vllm:{histogram}_bucket", f"vllm:{histogram}_count",
                f"vllm:{histogram}_sum"} <= names


def test_counters_move_with_requests(server: RemoteServer):
    before = scrape(server)
    first = complete(server, 5)
    second = complete(server, 5)  # same prompt: its first three blocks come from the cache
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert first["usage"]["completion_tokens"] == second["usage"]["completion_tokens"] == 5
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    assert delta("vllm:generation_tokens_total") == 10
    assert delta("vllm:prefix_cache_queries_total") == 2 * len(PROMPT)
    assert delta("vllm:prefix_cache_hits_total") >= 3 * 16
    assert delta("vllm:prompt_tokens_total") <= 2 * len(PROMPT) - 3 * 16
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == 2 * 4
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert delta("vllm:request_prompt_tokens_sum") == 2 * len(PROMPT)
    assert delta("vllm:request_generation_tokens_sum") == 10
    assert value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0
