"""`pagellm router` in front of a real `pagellm serve` replica of the embedded model."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from router_utils import RouterServer, wait_for
from server_utils import REPO_ROOT, RemoteServer, cli_env, free_port

PROMPT = ("You are the support assistant of a bicycle shop. Answer briefly and politely. "
          "Our opening hours are nine to six on weekdays and ten to four on Saturdays. ")


@pytest.fixture(scope="module")
def replica(smollm2_gguf: Path) -> Iterator[RemoteServer]:
    server = RemoteServer(smollm2_gguf, "--served-model-name", "SmolLM2-135M-Instruct",
                          startup_timeout=300)
    yield server
    server.stop()


@pytest.fixture
def router(replica: RemoteServer) -> Iterator[RouterServer]:
    config = {"groups": {"smol": {"model": "SmolLM2-135M-Instruct", "local": True,
                                  "balancing": "prefix", "backends": [replica.url]}}}
    with RouterServer(config) as server:
        yield server


def _texts(stream: openai.Stream) -> list[str]:
    return [chunk.choices[0].delta.content for chunk in stream if chunk.choices]


def test_stream_through_router_equals_stream_from_replica(replica: RemoteServer,
                                                          router: RouterServer) -> None:
    request = {"max_tokens": 12, "temperature": 0, "stream": True,
               "messages": [{"role": "user", "content": "Name a colour."}]}
    direct = _texts(replica.client().chat.completions.create(
        model="SmolLM2-135M-Instruct", **request))
    routed = _texts(router.client().chat.completions.create(model="smol", **request))
    assert routed == direct
    assert len(direct) > 2


def test_router_prefix_hashes_are_the_replicas(replica: RemoteServer,
                                               router: RouterServer) -> None:
    """The blocks the router predicts a replica holds are the blocks the replica's prefix
    cache reports as hits: same tokens, block size and hash chain."""
    prompt = PROMPT * 3
    count = httpx.post(f"{replica.url}/tokenize", json={"prompt": prompt}).json()["count"]
    if count % 16 == 0:   # the engine always computes a prompt's last token
        prompt += "Thanks."
    client = router.client()
    client.completions.create(model="smol", prompt=prompt, max_tokens=1)
    before = replica.metrics()["vllm:prefix_cache_hits_total"]
    matched_before = _sample(router.metrics_text(), "pagellm_router_prefix_blocks_matched")
    client.completions.create(model="smol", prompt=prompt, max_tokens=1)
    hits = replica.metrics()["vllm:prefix_cache_hits_total"] - before
    matched = _sample(router.metrics_text(), "pagellm_router_prefix_blocks_matched") - \
        matched_before
    assert matched >= 3
    assert hits == matched * 16


def test_disconnect_aborts_the_replicas_request(replica: RemoteServer,
                                                router: RouterServer) -> None:
    before = replica.metrics()["vllm:generation_tokens_total"]
    body = {"model": "smol", "prompt": "Count:", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body,
                      timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    wait_for(lambda: replica.metrics()["vllm:num_requests_running"] == 0,
             "the replica to drop the request", timeout=60)
    assert replica.metrics()["vllm:generation_tokens_total"] - before < 400


def test_cli_router_discovers_the_model_name(replica: RemoteServer) -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "pagellm.entrypoints.cli", "router", "--backend", replica.url,
         "--port", str(port)], cwd=REPO_ROOT, env=cli_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while not _healthy(url):
            assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert [model.id for model in client.models.list()] == ["SmolLM2-135M-Instruct"]
        answer = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=3,
            messages=[{"role": "user", "content": "Hi"}])
        assert answer.usage.completion_tokens == 3
    finally:
        process.terminate()
        output = process.communicate(timeout=20)[0]
    assert "Starting pagellm router on http://127.0.0.1:%d" % port in output


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _sample(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name + "_total"))
