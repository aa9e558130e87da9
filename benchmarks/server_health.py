"""Waiting for a server a benchmark started: its `/health`, polled until it answers 200."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_healthy(process: subprocess.Popen, url: str, timeout: float,
                 poll_seconds: float = 0.05) -> float:
    """Seconds until `url`/health answers 200. The process is killed, and the wait ends in an
    error, if it exits first or `timeout` seconds pass."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(poll_seconds)
    process.kill()
    raise RuntimeError(f"{' '.join(map(str, process.args[:5]))} did not become healthy "
                       f"(exit code {process.poll()})")
