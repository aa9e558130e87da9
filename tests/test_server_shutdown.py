"""SIGTERM: a drain, not a cut. /health turns 503 and new requests are refused while the
requests in flight finish; those still running at --shutdown-timeout end with an
in-band error and [DONE]; the server and its engine core exit 0."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
from server_utils import RemoteServer, assert_clean_shutdown, engine_core_pid
from test_server_errors import assert_error
from test_server_reliability import COMPLETION, hold_requests


def _stopped_cleanly(remote: RemoteServer, core_pid: int) -> None:
    """Exit code 0, and the engine core gone with it."""
    assert remote.process.wait(timeout=60) == 0, remote.output()[-3000:]
    assert not Path(f"/proc/{core_pid}").exists()
    assert "Shutting down: no new requests" in remote.output()
    assert_clean_shutdown(remote.stop())


def test_sigterm_lets_requests_in_flight_finish(tiny_llama_dir: Path) -> None:
    remote = RemoteServer(tiny_llama_dir, "--served-model-name", "tiny",
                          "--max-concurrent-requests", "1")
    core_pid = engine_core_pid(remote.process.pid)
    [held] = hold_requests(remote, limit=1)
    remote.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while httpx.get(f"{remote.url}/health").status_code != 503:
        assert time.monotonic() < deadline, "/health never turned 503"
        time.sleep(0.05)
    refused = httpx.post(f"{remote.url}/v1/completions", json=COMPLETION, timeout=30)
    assert_error(refused, 503, "ServiceUnavailableError", "shutting down")
    assert remote.process.poll() is None  # still waiting for the held request
    status, answer = held.finish()
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
    _stopped_cleanly(remote, core_pid)


def test_sigterm_ends_streams_past_the_timeout_with_an_error_and_done(
        tiny_llama_dir: Path) -> None:
    remote = RemoteServer(tiny_llama_dir, "--served-model-name", "tiny",
                          "--shutdown-timeout", "0")
    core_pid = engine_core_pid(remote.process.pid)
    body = {**COMPLETION, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{remote.url}/v1/completions", json=body, timeout=60) as response:
        lines = (line for line in response.iter_lines() if line)
        first = json.loads(next(lines)[6:])
        assert first["choices"]
        remote.process.send_signal(signal.SIGTERM)
        events = list(lines)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]
    _stopped_cleanly(remote, core_pid)
