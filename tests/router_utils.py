"""An in-process `pagellm router` on a free port, for the router tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import uvicorn

from pagellm.router.app import RouterState, build_app
from pagellm.router.backends import Backend
from pagellm.router.config import config_from_dict
from server_utils import free_port


class RouterServer:
    """The router app from a config mapping, served by uvicorn in a thread."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = config_from_dict({"probe_interval_s": 0.05, **config,
                                        "port": self.port})
        self.app = build_app(self.config)
        self.state: RouterState = self.app.state.router
        server_config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                       log_level="warning")
        self.server = uvicorn.Server(server_config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> RouterServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("router did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("api_key", "EMPTY")
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, **kwargs)

    def backend(self, url: str) -> Backend:
        """The router's live state of the backend at this root URL."""
        return next(b for b in self.state.pool.all() if b.config.root == url)

    def metrics_text(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5).text


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll until `predicate()` holds; fail (not hang) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
