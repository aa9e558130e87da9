"""Waiting for a server a benchmark started: its `/health`, polled until it answers 200."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_healthy(process: subprocess.Popen, url: str, timeout: float,
                 poll_seconds: float = 0.05, path: str = "/health") -> float:
    """Seconds until `url` + `path` answers 200 (llama-cpp-python's server has no /health:
    /v1/models). The process is killed, and the wait ends in an error, if it exits first or
    `timeout` seconds pass. One client polls: a new one per poll (httpx.get) costs about 20 ms
    of CPU, a third of a core at this rate, taken from the start being measured."""
    start = time.perf_counter()
    with httpx.Client(timeout=1) as client:
        while time.perf_counter() - start < timeout and process.poll() is None:
            try:
                if client.get(f"{url}{path}").status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(poll_seconds)
    process.kill()
    raise RuntimeError(f"{' '.join(map(str, process.args[:5]))} did not become healthy "
                       f"(exit code {process.poll()})")
