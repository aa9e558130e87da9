"""How hard a request's task is, for the rules' `complexity: simple | complex`.

Two tiers. The heuristic scores length, task words, code and numbered asks, with no call
out. The classifier, when configured, embeds the request's task (its last user message)
with an embedding model served by a local group (pagellm serving all-MiniLM-L6-v2, say)
and picks the label whose centroid of example prompts is nearer by cosine similarity. The
examples are embedded once, on first use. When the classifier cannot answer (no healthy
backend, an error, a timeout) the request gets the configured `on_error` tier: a
classifier outage moves requests to the side the operator chose, never to a guess.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import numpy as np
from prometheus_client import Counter

from pagellm.logger import init_logger
from pagellm.router.backends import BackendPool
from pagellm.router.config import ClassifierConfig, ComplexityConfig
from pagellm.router.pii import request_texts

logger = init_logger(__name__)


def complexity_score(body: dict[str, Any], config: ComplexityConfig) -> float:
    """A cheap estimate of how hard the task is: length, task words, code, several asks."""
    text = " ".join(request_texts({k: body.get(k) for k in ("messages", "prompt")})).lower()
    words = len(text.split())
    score = min(words / 150, 3.0)
    score += min(sum(1.0 for word in config.keywords if word in text), 3.0)
    score += 1.0 if "```" in text else 0.0
    score += min(max(text.count("?") - 1, 0) * 0.5, 1.0)
    score += 1.0 if len(re.findall(r"(?m)^\s*\d+[.)]\s", text)) >= 3 else 0.0
    return score


def task_text(body: dict[str, Any]) -> str:
    """What the classifier judges: the last user message of a chat (the system prompt and
    history describe the setting, not this task), else the whole prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in reversed(messages):
            if isinstance(message, dict) and message.get("role") == "user":
                return " ".join(request_texts(message.get("content")))
    return " ".join(request_texts(body.get("prompt")))


def _normalized(vectors: list[list[float]]) -> np.ndarray:
    array = np.asarray(vectors, dtype=np.float64)
    return array / np.maximum(np.linalg.norm(array, axis=-1, keepdims=True), 1e-12)


class ComplexityEstimator:
    def __init__(self, config: ComplexityConfig, pool: BackendPool, client: httpx.AsyncClient,
                 counter: Counter) -> None:
        self.config = config
        self.pool = pool
        self.client = client
        self.counter = counter       # labels: tier, source
        self._centroids: np.ndarray | None = None   # rows: simple, complex
        self._lock = asyncio.Lock()

    async def tier(self, body: dict[str, Any]) -> str:
        classifier = self.config.classifier
        if classifier is None:
            score = complexity_score(body, self.config)
            return self._count("complex" if score >= self.config.threshold else "simple",
                               "heuristic")
        try:
            return self._count(await self._classify(classifier, task_text(body)), "classifier")
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
            logger.warning("Complexity classifier failed (%s); using tier %s",
                           type(error).__name__, classifier.on_error)
            return self._count(classifier.on_error, "classifier-error")

    def _count(self, tier: str, source: str) -> str:
        self.counter.labels(tier, source).inc()
        return tier

    async def _classify(self, classifier: ClassifierConfig, text: str) -> str:
        centroids = await self._centroids_of(classifier)
        vector = _normalized(await self._embed(classifier, [text or " "]))[0]
        similarity = centroids @ vector
        return "complex" if similarity[1] - similarity[0] > classifier.margin else "simple"

    async def _centroids_of(self, classifier: ClassifierConfig) -> np.ndarray:
        async with self._lock:
            if self._centroids is None:
                vectors = _normalized(await self._embed(
                    classifier, [*classifier.simple, *classifier.complex]))
                count = len(classifier.simple)
                means = np.stack([vectors[:count].mean(axis=0), vectors[count:].mean(axis=0)])
                self._centroids = _normalized(means.tolist())
            return self._centroids

    async def _embed(self, classifier: ClassifierConfig, texts: list[str]) -> list[list[float]]:
        """Embeddings from the first healthy backend of the classifier's group; inputs over
        the model's limit are cut to it (`truncate_prompt_tokens: -1`)."""
        backends = self.pool.available(classifier.group)
        if not backends:
            raise ValueError(f"no healthy backend in group {classifier.group}")
        backend = backends[0]
        body = {"model": self.pool.group_config(classifier.group).model, "input": texts,
                "truncate_prompt_tokens": -1}
        key = backend.config.api_key()
        response = await self.client.post(
            f"{backend.config.url}/embeddings", json=body, timeout=classifier.timeout_s,
            headers={"Authorization": f"Bearer {key}"} if key else None)
        response.raise_for_status()
        data = sorted(response.json()["data"], key=lambda item: item["index"])
        if len(data) != len(texts):
            raise ValueError("the embedding server answered for another number of inputs")
        return [item["embedding"] for item in data]
