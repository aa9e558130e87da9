"""A tensor parallel server, through the openai SDK: it serves, and when a rank dies mid-run
the request in flight gets a 503 and the server exits non-zero, leaving no process behind."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import openai
import psutil
from server_utils import RemoteServer

WORKER_MODULE = "pagellm.distributed.worker"


def _workers(server: RemoteServer) -> list[psutil.Process]:
    children = psutil.Process(server.process.pid).children(recursive=True)
    return [child for child in children if WORKER_MODULE in " ".join(child.cmdline())]


def _wait_running(server: RemoteServer) -> None:
    deadline = time.monotonic() + 60
    while server.metrics().get("vllm:num_requests_running", 0) < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.1)


def test_a_dying_rank_is_a_503_and_a_non_zero_exit(tiny_llama_dir: Path) -> None:
    server = RemoteServer(tiny_llama_dir, "-tp", "2")
    try:
        client = server.client()
        answer = client.completions.create(model=str(tiny_llama_dir), prompt="Hello",
                                           max_tokens=4, temperature=0)
        assert answer.choices[0].text
        workers = _workers(server)
        assert len(workers) == 1
        family = [psutil.Process(server.process.pid), *psutil.Process(
            server.process.pid).children(recursive=True)]
        errors: list[Exception] = []

        def long_request() -> None:
            try:
                client.completions.create(model=str(tiny_llama_dir), prompt="Once upon",
                                          max_tokens=1000, temperature=0,
                                          extra_body={"ignore_eos": True})
            except openai.APIStatusError as error:
                errors.append(error)

        thread = threading.Thread(target=long_request)
        thread.start()
        _wait_running(server)
        workers[0].kill()
        thread.join(timeout=60)
        assert [error.status_code for error in errors] == [503]
        assert server.process.wait(timeout=60) == 1
        gone, alive = psutil.wait_procs(family, timeout=30)
        assert not alive
    finally:
        server.stop()
