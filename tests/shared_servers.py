"""`pagellm serve` processes that several test files start with the same flags, shared.

A start costs 4 to 6 s on two cores, and each of these flag sets was started by two files:

- `tiny_server`: the tiny llama as "tiny" (test_metrics.py, test_rag_service.py)
- `hermes_server`: the tiny llama with the Hermes tool parser and template
  (test_server_agents.py, test_server_responses.py)
- `minilm_server`: all-MiniLM-L6-v2 as "minilm" (test_embeddings.py,
  test_router_classifier.py)

The fixtures (session-scoped, in conftest.py) start one on first use and stop it, checking
that its log has no traceback, in the teardown of the last collected test that uses it
(last_use.py).
A test reads what the server counts as deltas (its own requests) and leaves no request
running, as it did when the server was its module's. (test_router_replica.py and
test_web_playground.py start the embedded GGUF with the same flags too, but the page
checks a fresh server's free blocks, which the router's cached prefixes would change.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from last_use import release_after_last_use, release_now
from server_utils import REPO_ROOT, RemoteServer, assert_clean_shutdown

HERMES_TEMPLATE = REPO_ROOT / "examples" / "tool_chat_template_hermes.jinja"
FLAGS = {
    "tiny_server": ("--served-model-name", "tiny"),
    "hermes_server": ("--served-model-name", "tiny", "--enable-auto-tool-choice",
                      "--tool-call-parser", "hermes", "--chat-template", str(HERMES_TEMPLATE)),
    "minilm_server": ("--max-model-len", "256", "--served-model-name", "minilm"),
}


def shared_server(name: str, model: Path, startup_timeout: float = 300
                  ) -> Iterator[RemoteServer]:
    """The body of the session fixture `name`: FLAGS[name] on `model`, stopped after the
    last test that uses it (last_use.py), its log checked for tracebacks."""
    server = RemoteServer(model, *FLAGS[name], startup_timeout=startup_timeout)
    release_after_last_use(name, lambda: assert_clean_shutdown(server.stop()))
    yield server
    release_now(name)
