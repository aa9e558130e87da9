"""Bodies of the pooling routes: `/v1/embeddings` (OpenAI's, with vLLM's extras),
`/score` (vLLM's) and `/rerank` (Jina's and Cohere's shape, as vLLM answers it)."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import Field

from pagellm.entrypoints.openai.protocol import OpenAIBaseModel, OpenAIRequestModel

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class PoolingUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: None = None


class EmbeddingRequest(OpenAIRequestModel):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # vLLM: keep at most this many tokens of each input (-1: the model's limit)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool = True
    priority: int = 0


class EmbeddingData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: _id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ScoreRequest(OpenAIRequestModel):
    """`text_1` against each of `text_2` (one to many), or pair by pair (equal lists)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    user: str | None = None
    priority: int = 0


class ScoreData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: _id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankRequest(OpenAIRequestModel):
    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=0)  # None or 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    user: str | None = None
    priority: int = 0


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: _id("rerank"))
    model: str
    usage: RerankUsage
    results: list[RerankResult]
