"""The router tests' gateway: two fake local replicas and a fake external provider.

Each fake records every body it receives, so a test can check what left: a request carrying
customer data must never appear in the external fake's log, whatever fails. Test modules
import the fixtures (`fakes`, `a`, `b`, `ext`) from here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fake_openai_server import FakeOpenAIServer
from router_utils import RouterServer

EXTERNAL_KEY = "sk-external-secret-123"
TENANT_KEY = "tenant-acme-key"
LONG_TASK = ("Design the architecture of a distributed payment system, compare the trade-off "
             "between two algorithm choices and explain why, step by step.")


@pytest.fixture(scope="module")
def fakes() -> Iterator[dict[str, FakeOpenAIServer]]:
    servers = {"a": FakeOpenAIServer("local-model"), "b": FakeOpenAIServer("local-model"),
               "ext": FakeOpenAIServer("cloud-model")}
    for server in servers.values():
        server.start()
    yield servers
    for server in servers.values():
        server.stop()


@pytest.fixture
def a(fakes: dict[str, FakeOpenAIServer]) -> FakeOpenAIServer:
    fakes["a"].reset()
    return fakes["a"]


@pytest.fixture
def b(fakes: dict[str, FakeOpenAIServer]) -> FakeOpenAIServer:
    fakes["b"].reset()
    return fakes["b"]


@pytest.fixture
def ext(fakes: dict[str, FakeOpenAIServer], monkeypatch: pytest.MonkeyPatch
        ) -> FakeOpenAIServer:
    monkeypatch.setenv("ROUTER_TEST_EXTERNAL_KEY", EXTERNAL_KEY)
    monkeypatch.setenv("ROUTER_TEST_ACME_KEY", TENANT_KEY)
    fakes["ext"].reset()
    return fakes["ext"]


def gateway_config(a: FakeOpenAIServer, b: FakeOpenAIServer, ext: FakeOpenAIServer,
                   balancing: str = "least_loaded", **extra: Any) -> dict[str, Any]:
    """The seeds' set-up: customer data local, complex or long tasks external, and by
    default (the riskiest choice for a leak) external first, local as fallback."""
    return {
        "groups": {
            "local": {"model": "local-model", "local": True, "balancing": balancing,
                      "backends": [a.url, b.url]},
            "cloud": {"model": "cloud-model", "probe": False,
                      "api_key_env": "ROUTER_TEST_EXTERNAL_KEY", "backends": [ext.url]},
        },
        "models": {"assistant": {
            "default": "cloud", "fallbacks": ["local"],
            "rules": [{"name": "simple", "when": {"complexity": "simple"}, "target": "local"},
                      {"name": "complex", "when": {"complexity": "complex"},
                       "target": "cloud"}]}},
        "tenants": {"acme": "ROUTER_TEST_ACME_KEY"},
        "privacy": {"customer_names": ["Jane Doe"], "patterns": {"contract": r"CT-\d{6}"},
                    "tenants": ["acme"]},
        "max_failures": 1,
        **extra,
    }


def chat(router: RouterServer, content: str, **kwargs: Any) -> Any:
    """A chat request through the SDK; returns the raw response (headers + parsed)."""
    api_key = kwargs.pop("api_key", "EMPTY")
    return router.client(api_key=api_key).chat.completions.with_raw_response.create(
        model=kwargs.pop("model", "assistant"), max_tokens=4,
        messages=[{"role": "user", "content": content}], **kwargs)
