"""The complexity classifier tier: requests embedded by a real pagellm embedding server
(all-MiniLM-L6-v2) and sent by the nearest centroid of labelled examples; the configured
tier when the classifier is down."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from fake_openai_server import FakeOpenAIServer
from router_gateway import LONG_TASK, a, b, chat, ext, fakes, gateway_config  # noqa: F401
from router_utils import RouterServer
from server_utils import REPO_ROOT, RemoteServer, free_port

from pagellm.router.complexity import complexity_score
from pagellm.router.config import ComplexityConfig, config_from_dict

SIMPLE = ["What is the capital of France?", "Say hello in Spanish.",
          "How many days are in a week?", "Translate 'thank you' into German.",
          "What colour is a ripe banana?"]
COMPLEX = ["Write a concurrent web crawler in Rust with rate limiting, retries and tests.",
           "Work out the asymptotic running time of this recursive function and justify it.",
           "Draft a migration of a monolithic database to sharded Postgres with no downtime.",
           "Find the race condition in this multithreaded queue and fix it.",
           "Derive the gradient of the softmax cross-entropy loss with respect to the logits."]
# short and without any of the heuristic's task words: the heuristic calls it simple
HARD_QUESTION = "Implement a lock-free hash map in C++ that supports concurrent resizing."


@pytest.fixture(scope="module")
def minilm(minilm_server: RemoteServer) -> RemoteServer:
    """all-MiniLM-L6-v2 as "minilm", shared with test_embeddings.py (shared_servers.py)."""
    return minilm_server


def classified_config(a: FakeOpenAIServer, b: FakeOpenAIServer, ext: FakeOpenAIServer,
                      embed_url: str, on_error: str = "simple") -> dict[str, Any]:
    config = gateway_config(a, b, ext, complexity={"classifier": {
        "group": "embed", "simple": SIMPLE, "complex": COMPLEX, "on_error": on_error}})
    config["groups"]["embed"] = {"model": "minilm", "local": True, "backends": [embed_url]}
    return config


def test_classifier_routes_by_nearest_examples(minilm: RemoteServer, a: FakeOpenAIServer,
                                               b: FakeOpenAIServer,
                                               ext: FakeOpenAIServer) -> None:
    assert complexity_score({"prompt": HARD_QUESTION}, ComplexityConfig()) < 3.0
    with RouterServer(classified_config(a, b, ext, minilm.url)) as router:
        hard = chat(router, HARD_QUESTION)
        easy = chat(router, "What is the boiling point of water?")
        metrics = router.metrics_text()
    assert hard.headers["x-pagellm-route"] == "rule=complex; target=cloud; sensitive=false"
    assert easy.headers["x-pagellm-route"] == "rule=simple; target=local; sensitive=false"
    assert [body["messages"][0]["content"] for body in ext.state.bodies] == [HARD_QUESTION]
    assert ('pagellm_router_complexity_total{source="classifier",tier="complex"} 1.0'
            in metrics)


@pytest.mark.parametrize("on_error, route", [
    ("simple", "rule=simple; target=local"), ("complex", "rule=complex; target=cloud")])
def test_classifier_down_gives_the_configured_tier(on_error: str, route: str,
                                                   a: FakeOpenAIServer, b: FakeOpenAIServer,
                                                   ext: FakeOpenAIServer) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    with RouterServer(classified_config(a, b, ext, nowhere, on_error)) as router:
        raw = chat(router, LONG_TASK if on_error == "simple" else "Hi there.")
        metrics = router.metrics_text()
    assert raw.headers["x-pagellm-route"].startswith(route)
    assert (f'pagellm_router_complexity_total{{source="classifier-error",tier="{on_error}"}} '
            f'1.0' in metrics)


def test_classifier_group_must_be_local(a: FakeOpenAIServer, b: FakeOpenAIServer,
                                        ext: FakeOpenAIServer) -> None:
    config = classified_config(a, b, ext, "http://127.0.0.1:9")
    config["groups"]["embed"]["local"] = False
    with pytest.raises(ValueError, match="classifier.group 'embed' must name a group"):
        config_from_dict(config)
    config["complexity"]["classifier"]["complex"] = []
    with pytest.raises(ValueError, match="needs `simple` and `complex` examples"):
        config_from_dict(config)


def test_the_documented_classifier_config_loads() -> None:
    text = (REPO_ROOT / "docs" / "router.md").read_text()
    block = text.split("```yaml\ngroups:\n  embed:", 1)[1].split("```", 1)[0]
    config = config_from_dict(yaml.safe_load("groups:\n  embed:" + block))
    classifier = config.complexity.classifier
    assert classifier is not None and classifier.group == "embed"
    assert classifier.on_error == "simple" and len(classifier.complex) == 2
