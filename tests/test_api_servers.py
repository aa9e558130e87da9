"""`--api-server-count 2`: two API server processes on one port in front of the engine
cores. Each answer names the process that served it (`pagellm-api-server`), both serve,
greedy answers are the single server's, /metrics sums both processes, aborts free blocks,
and the server stops as a whole: SIGTERM drains (exit 0), a dead front end or engine stops
it non-zero with no process left."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import Pipe
from pathlib import Path

import httpx
import pytest
from server_utils import RemoteServer, assert_clean_shutdown

from pagellm.core.sched_output import RequestUpdate, SchedulerStats
from pagellm.engine.client_hub import FrontEndHub
from pagellm.engine.core_client import (AddRequest, CheckKVCache, FinishRequests, Shutdown,
                                        StepResult)
from pagellm.entrypoints.cli import build_parser
from pagellm.entrypoints.llm import LLM
from pagellm.entrypoints.openai.api_servers import check_supported
from pagellm.entrypoints.openai.cli_args import ServerSettings
from pagellm.metrics.loggers import LoggingStatLogger
from pagellm.metrics.stats import IterationStats
from pagellm.request import Request, RequestStatus
from pagellm.sampling_params import SamplingParams

SERVED_BY = "pagellm-api-server"
PROMPTS = [f"Request number {index} says" for index in range(16)]


def _start(model: Path, *extra: str) -> RemoteServer:
    """Ready once both front ends listen: until then the kernel gives every connection to
    the one that does."""
    server = RemoteServer(model, "--api-server-count", "2", *extra)
    deadline = time.monotonic() + 60
    while server.output().count("pagellm is ready") < 2:
        assert server.process.poll() is None and time.monotonic() < deadline, server.output()
        time.sleep(0.1)
    return server


def _children(pid: int) -> dict[str, int]:
    """The server's child processes, by name (APIServer_0, EngineCore_DP1, ...)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return {Path(f"/proc/{child}/comm").read_text().strip(): int(child) for child in children}


@pytest.fixture(scope="module")
def greedy(tiny_llama_dir: Path) -> list[str]:
    """The single-process engine's greedy answers to PROMPTS."""
    single = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256,
                 kv_cache_memory=1 << 24)
    return [output.outputs[0].text for output in single.generate(
        PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))]


def _ask_all(server: RemoteServer, model: str) -> tuple[list[str], set[str], int]:
    """Each prompt on a connection of its own, eight at once: the answers, the front ends
    that served them, and the tokens generated."""

    def ask(index: int) -> tuple[str, str, int]:
        raw = server.client().completions.with_raw_response.create(
            model=model, prompt=PROMPTS[index], max_tokens=6, temperature=0,
            n=1 + index % 2, extra_body={"ignore_eos": True})
        answer = raw.parse()
        assert all(choice.finish_reason == "length" for choice in answer.choices)
        return answer.choices[0].text, raw.headers[SERVED_BY], answer.usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(len(PROMPTS))))
    return ([text for text, _, _ in results], {served for _, served, _ in results},
            sum(tokens for _, _, tokens in results))


def _samples(server: RemoteServer, name: str) -> dict[str, float]:
    """A metric's samples by engine label, summed over its other labels."""
    pattern = re.compile(rf'^{re.escape(name)}{{engine="(\d+)"[^}}]*}} (\S+)$')
    totals: dict[str, float] = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=5).text.splitlines():
        match = pattern.match(line)
        if match:
            totals[match[1]] = totals.get(match[1], 0.0) + float(match[2])
    return totals


def _wait_idle(server: RemoteServer) -> dict:
    """The engines' KV report once no request is left (aborts take a step to land)."""
    deadline = time.monotonic() + 30
    while True:
        report = httpx.get(f"{server.url}/debug/kv-cache", timeout=30).json()
        if report["num_requests"] == 0 or time.monotonic() > deadline:
            return report
        time.sleep(0.1)


@dataclass
class _Stream:
    """A streamed completion, its first token read; the rest waits for `close()`."""

    response: httpx.Response
    lines: Iterator[str]  # kept: dropping the iterator would close the connection

    @property
    def served_by(self) -> str:
        return self.response.headers[SERVED_BY]

    def close(self) -> None:
        self.response.close()


def _open_stream(server: RemoteServer, client: httpx.Client) -> _Stream:
    body = {"model": "m", "prompt": "Tell a long story", "max_tokens": 1000, "stream": True,
            "ignore_eos": True}
    request = client.build_request("POST", f"{server.url}/v1/completions", json=body)
    response = client.send(request, stream=True)
    assert response.status_code == 200
    lines = response.iter_lines()
    while not next(lines).startswith("data: {"):
        pass
    return _Stream(response, lines)


def test_two_api_servers_share_one_engine(tiny_llama_dir: Path, greedy: list[str]) -> None:
    server = _start(tiny_llama_dir, "--served-model-name", "m")
    try:
        assert {"APIServer_0", "APIServer_1", "EngineCore"} <= set(_children(server.process.pid))
        answers, served_by, tokens = _ask_all(server, "m")
        assert answers == greedy and served_by == {"0", "1"}
        assert sum(_samples(server, "vllm:request_success_total").values()) == len(PROMPTS)
        assert _samples(server, "vllm:generation_tokens_total") == {"0": tokens}
        assert _samples(server, "vllm:num_requests_running") == {"0": 0.0}  # one sample
        streams: list[_Stream] = []
        with httpx.Client(timeout=60) as client:
            while {stream.served_by for stream in streams} != {"0", "1"}:  # one on each
                streams.append(_open_stream(server, client))
            running = _samples(server, "vllm:num_requests_running")["0"]
            assert running == len(streams)  # the engine's figure, recorded once
            for stream in streams:
                stream.close()  # a client that leaves: its request is aborted
        report = _wait_idle(server)
        assert (report["num_requests"], report["used_blocks"], report["problem"]) == (0, 0, None)
        generated = _samples(server, "vllm:generation_tokens_total")["0"] - tokens
        assert generated < 1000 * len(streams)
        assert server.output().count("Available routes are:") == 1
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0
        assert server.output().count("Shutting down: no new requests") == 2
        assert_clean_shutdown(server.output())
    finally:
        server.stop()


def test_every_api_server_balances_over_every_engine(tiny_llama_dir: Path,
                                                     greedy: list[str]) -> None:
    """-dp 2: both front ends send to both engines; an engine's death stops the server."""
    server = _start(tiny_llama_dir, "-dp", "2", "--served-model-name", "m")
    try:
        answers, served_by, _ = _ask_all(server, "m")
        assert answers == greedy and served_by == {"0", "1"}
        served = _samples(server, "vllm:request_success_total")
        assert set(served) == {"0", "1"} and sum(served.values()) == len(PROMPTS)
        assert _samples(server, "vllm:num_requests_waiting") == {"0": 0.0, "1": 0.0}
        os.kill(_children(server.process.pid)["EngineCore_DP1"], signal.SIGKILL)
        assert server.process.wait(timeout=60) == 1
        output = server.output()
        assert output.count("Exiting because the engine core process died.") == 2
        assert "EngineCore_DP1 exited with code -9" in output
    finally:
        server.stop()


def test_a_dead_api_server_stops_the_server_and_frees_its_requests(
        tiny_llama_dir: Path) -> None:
    server = _start(tiny_llama_dir, "--served-model-name", "m")
    children = _children(server.process.pid)
    try:
        with httpx.Client(timeout=60) as client:
            stream = _open_stream(server, client)
            while stream.served_by != "1":  # a request in flight on APIServer_1
                stream.close()
                stream = _open_stream(server, client)
            os.kill(children["APIServer_1"], signal.SIGKILL)
            assert server.process.wait(timeout=60) == 1
        output = server.output()
        assert "API server 1 left with 1 request(s) in flight; aborting them." in output
        assert "APIServer_1 exited with code -9; stopping the other API servers." in output
        assert not any(Path(f"/proc/{pid}").exists() for pid in children.values())
    finally:
        server.stop()


def _update(request_id: str, finished: bool = False) -> RequestUpdate:
    return RequestUpdate(request_id, None, 0, [7], [None], "length" if finished else None)


def test_the_hub_keeps_each_front_ends_requests_its_own() -> None:
    """Two front ends send the same request id: each gets only its own tokens back, every
    step's stats reach both, a reply goes to the asker, and a front end that leaves has
    what it still runs aborted."""
    pipes = [Pipe() for _ in range(2)]
    hub = FrontEndHub([engine_end for engine_end, _ in pipes])
    front = [front_end for _, front_end in pipes]
    hub.send("ready")  # before any ask: to every front end
    assert [conn.recv() for conn in front] == ["ready", "ready"]
    for conn in front:
        conn.send(AddRequest(Request("cmpl-1", [1, 2], SamplingParams(n=2), max_tokens=4)))
    first, second = hub.recv(), hub.recv()
    assert {first.request.request_id, second.request.request_id} == {"0|cmpl-1", "1|cmpl-1"}
    stats = SchedulerStats(2, 0, 0.0, 0, 0, 0)
    hub.send(StepResult([_update("0|cmpl-1"), _update("1|cmpl-1#1", finished=True)], stats))
    mine, theirs = front[0].recv(), front[1].recv()
    assert [u.request_id for u in mine.updates] == ["cmpl-1"] and mine.stats == stats
    assert [u.request_id for u in theirs.updates] == ["cmpl-1#1"] and theirs.stats == stats
    front[1].send(CheckKVCache())
    assert isinstance(hub.recv(), CheckKVCache)
    hub.send("report")
    assert front[1].recv() == "report" and not front[0].poll()
    front[0].send(FinishRequests(["cmpl-1#1"], RequestStatus.FINISHED_ABORTED))
    assert hub.recv().request_ids == ["0|cmpl-1#1"]
    front[1].close()  # its process died: its unfinished sequence is aborted
    assert hub.poll()
    aborted = hub.recv()
    assert (aborted.request_ids, aborted.status) == (["1|cmpl-1"],
                                                     RequestStatus.FINISHED_ABORTED)
    front[0].send(Shutdown())
    assert hub.recv().request_ids == ["0|cmpl-1"]
    with pytest.raises(EOFError):  # every front end has left: the engine core ends
        hub.recv()


def test_the_engine_line_counts_the_tokens_of_every_front_end() -> None:
    """APIServer_0 logs the engine's line: its generation throughput is the engine's count,
    not that of APIServer_0's own requests."""
    shared, alone = LoggingStatLogger(engine_tokens=True), LoggingStatLogger()
    for line in (shared, alone):
        line.record(SchedulerStats(3, 0, 0.0, 4, 6, 0), IterationStats(num_generation_tokens=2))
    assert (shared.generation_tokens, alone.generation_tokens) == (6, 2)


@pytest.mark.parametrize("flags, message", [
    (("--runner", "pooling"), "api_server_count 2 with a pooling (embedding) model is not "
                              "supported by pagellm yet"),
    (("--enable-lora", "--enable-runtime-lora-updating"),
     "api_server_count 2 with runtime LoRA loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING) is not "
     "supported by pagellm yet"),
])
def test_servers_not_built_for_several_front_ends_are_refused(
        tiny_llama_dir: Path, flags: tuple[str, ...], message: str) -> None:
    args = build_parser().parse_args(["serve", str(tiny_llama_dir), "--api-server-count", "2",
                                      *flags])
    with pytest.raises(ValueError, match=re.escape(message)):
        check_supported(ServerSettings.from_args(args))
