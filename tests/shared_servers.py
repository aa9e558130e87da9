"""`pagellm serve` processes that several test files start with the same flags, shared.

A start costs 4 to 6 s on two cores, and each of these flag sets was started by two files:

- `tiny_server`: the tiny llama as "tiny" (test_metrics.py, test_rag_service.py)
- `hermes_server`: the tiny llama with the Hermes tool parser and template
  (test_server_agents.py, test_server_responses.py)
- `minilm_server`: all-MiniLM-L6-v2 as "minilm" (test_embeddings.py,
  test_router_classifier.py)

The fixtures (session-scoped, in conftest.py) start one on first use; `release_after`
stops it, and checks that its log has no traceback, in the teardown of the last collected
test that uses it, so that an idle server holds no memory for the rest of the session.
A test reads what the server counts as deltas (its own requests) and leaves no request
running, as it did when the server was its module's. (test_router_replica.py and
test_web_playground.py start the embedded GGUF with the same flags too, but the page
checks a fresh server's free blocks, which the router's cached prefixes would change.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_utils import REPO_ROOT, RemoteServer, assert_clean_shutdown

HERMES_TEMPLATE = REPO_ROOT / "examples" / "tool_chat_template_hermes.jinja"
FLAGS = {
    "tiny_server": ("--served-model-name", "tiny"),
    "hermes_server": ("--served-model-name", "tiny", "--enable-auto-tool-choice",
                      "--tool-call-parser", "hermes", "--chat-template", str(HERMES_TEMPLATE)),
    "minilm_server": ("--max-model-len", "256", "--served-model-name", "minilm"),
}
_running: dict[str, RemoteServer] = {}


def shared_server(name: str, model: Path, startup_timeout: float = 300
                  ) -> Iterator[RemoteServer]:
    """The body of the session fixture `name`: FLAGS[name] on `model`."""
    _running[name] = RemoteServer(model, *FLAGS[name], startup_timeout=startup_timeout)
    yield _running[name]
    _stop(name)


def _stop(name: str) -> None:
    server = _running.pop(name, None)
    if server is not None:
        assert_clean_shutdown(server.stop())


def release_after(item: pytest.Item) -> None:
    """Stops the shared servers that no test after `item` uses (from the teardown of
    `item`, whose error a failed check then is)."""
    if not _running:
        return
    items = item.session.items
    position = {id(each): index for index, each in enumerate(items)}.get(id(item))
    if position is None:
        return
    later = items[position + 1:]
    for name in list(_running):
        if not any(name in getattr(each, "fixturenames", ()) for each in later):
            _stop(name)
