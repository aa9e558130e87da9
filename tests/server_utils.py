"""A real `pagellm serve` subprocess for the server tests, and small helpers around it."""

from __future__ import annotations

import functools
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

REPO_ROOT = Path(__file__).resolve().parent.parent
# fp32, a small context and a fixed, small KV cache keep start-up and steps fast.
TINY_SERVER_ARGS = ("--dtype", "float32", "--max-model-len", "1024", "--block-size", "16",
                    "--num-gpu-blocks-override", "512", "--disable-log-requests",
                    "--uvicorn-log-level", "warning")
_API_KEY_ENV = ("PAGELLM_API_KEY", "VLLM_API_KEY")


@functools.cache
def _default_context() -> ssl.SSLContext:
    return ssl.create_default_context()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cli_env() -> dict[str, str]:
    """The environment for a `pagellm` subprocess: this checkout first, no API key set."""
    env = {k: v for k, v in os.environ.items() if k not in _API_KEY_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def run_cli(*args: str, stdin: str = "", timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout,
                          env={**cli_env(), **(env or {})}, cwd=REPO_ROOT)


class RemoteServer:
    """`pagellm serve MODEL --port P ...` in a subprocess, ready once /health answers 200."""

    def __init__(self, model: Path, *extra_args: str, api_key: str | None = None,
                 startup_timeout: float = 120, tls_cert: Path | None = None,
                 env: dict[str, str] | None = None, wait: bool = True) -> None:
        """`tls_cert`: the server's self-signed certificate, when it serves https; `wait`
        False: return once started, and call `wait_healthy` later."""
        self.port = free_port()
        self.url = f"{'https' if tls_cert else 'http'}://127.0.0.1:{self.port}"
        # an SSLContext made once: httpx makes one per call from `True` (30 ms of CPU)
        self.verify: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=str(tls_cert)) if tls_cert else _default_context())
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagellm-serve-", suffix=".log")
        command = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", str(model),
                   "--port", str(self.port), *TINY_SERVER_ARGS, *extra_args]
        if api_key is not None:
            command += ["--api-key", api_key]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**cli_env(), **(env or {})}, cwd=REPO_ROOT)
        if wait:
            self.wait_healthy(startup_timeout)

    def wait_healthy(self, timeout: float = 120) -> None:
        """Polls /health every 50 ms, through one client."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=1, verify=self.verify) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    code = self.process.returncode
                    raise RuntimeError(f"server exited with {code}:\n{self.output()}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.stop()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def client(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "EMPTY",
                             max_retries=0, **kwargs)

    def async_client(self, **kwargs: object) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "EMPTY",
                                  max_retries=0, **kwargs)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of the `vllm:` samples: {"vllm:num_requests_running": 0.0, ...}."""
        text = httpx.get(f"{self.url}/metrics", timeout=5, verify=self.verify).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:") and "finished_reason" not in line:
                name, _, value = line.rpartition(" ")
                values[name.split("{")[0]] = float(value)
        return values

    def stop(self) -> str:
        """Stop the server; returns everything it printed."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        output = self.output()
        self.log.close()
        return output


def engine_core_pid(server_pid: int) -> int:
    """The server's child that named itself EngineCore (forked or spawned)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    for child in map(int, children):
        if Path(f"/proc/{child}/comm").read_text().startswith("EngineCore"):
            return child
    raise AssertionError(f"no engine core process among {children}")


def assert_clean_shutdown(output: str) -> None:
    """No traceback in a server's log: client mistakes must not reach the error path."""
    assert "Traceback" not in output, output[-6000:]
