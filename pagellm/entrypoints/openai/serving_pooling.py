"""`/v1/embeddings`, `/score` and `/rerank` over the batched pooling engine.

Inputs longer than the model's limit are a 400 that says how long they are: silently
cutting at 256 tokens (all-MiniLM-L6-v2's max_seq_length) is the most common quality
bug of embedding pipelines. `truncate_prompt_tokens` asks for truncation explicitly;
text is then cut by the tokenizer at the end and keeps its special tokens (as
sentence-transformers does), token ids keep their first tokens.
Scores are the cosine similarity of the two texts' embeddings (a bi-encoder, which is
what vLLM computes for an embedding model).
"""

from __future__ import annotations

import asyncio
import base64
from http import HTTPStatus

import torch
import torch.nn.functional as F

from pagellm.entrypoints.openai.errors import OpenAIError
from pagellm.entrypoints.openai.pooling_protocol import (EmbeddingData, EmbeddingInput,
                                                         EmbeddingRequest, EmbeddingResponse,
                                                         PoolingUsage, RerankDocument,
                                                         RerankRequest, RerankResponse,
                                                         RerankResult, RerankUsage, ScoreData,
                                                         ScoreRequest, ScoreResponse)
from pagellm.pooling.engine import AsyncPoolingEngine


class OpenAIServingPooling:
    def __init__(self, engine: AsyncPoolingEngine, model_names: list[str]) -> None:
        self.engine = engine
        self.model_names = model_names

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.model_names:
            return model or self.model_names[0]
        raise OpenAIError(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, "model")

    @staticmethod
    def check_priority(priority: int) -> None:
        if priority != 0:
            raise OpenAIError(f"Got priority {priority} but Priority scheduling is not "
                              "enabled.", param="priority")

    def _limit(self, truncate: int | None) -> int | None:
        max_len = self.engine.info.max_model_len
        if truncate is None:
            return None
        if truncate > max_len:
            raise OpenAIError(f"truncate_prompt_tokens value ({truncate}) is greater than "
                              f"max_model_len ({max_len}). Please, select a smaller "
                              "truncation size.", param="truncate_prompt_tokens")
        return max_len if truncate == -1 else truncate

    async def tokenize(self, inputs: EmbeddingInput, truncate: int | None = None,
                       add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each input, checked against the model's limit."""
        limit = self._limit(truncate)
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]  # one text or one list of token ids
        if not inputs:
            raise OpenAIError("input must not be empty.", param="input")
        if isinstance(inputs[0], str):
            ids = await asyncio.to_thread(self._encode_texts, list(inputs), limit,
                                          add_special_tokens)
        else:
            ids = [self._check_ids(list(tokens), limit) for tokens in inputs]
        for tokens in ids:
            if not tokens:
                raise OpenAIError("An input has no tokens; embeddings need at least one.",
                                  param="input")
            self._check_length(len(tokens))
        return ids

    def _encode_texts(self, texts: list[str], limit: int | None,
                      add_special_tokens: bool) -> list[list[int]]:
        tokenizer = self.engine.tokenizer
        if limit is None:
            return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
        return tokenizer(texts, add_special_tokens=add_special_tokens, truncation=True,
                         max_length=limit)["input_ids"]

    def _check_ids(self, tokens: list[int], limit: int | None) -> list[int]:
        vocab = self.engine.info.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"Token id {bad[0]} is out of vocabulary (size {vocab}).",
                              param="input")
        return tokens[:limit] if limit is not None else tokens

    def _check_length(self, num_tokens: int) -> None:
        max_len = self.engine.info.max_model_len
        if num_tokens > max_len:
            raise OpenAIError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {num_tokens} tokens in the input for embedding generation. Please "
                "reduce the length of the input (or set truncate_prompt_tokens).",
                param="input")

    def _resize(self, vectors: torch.Tensor, dimensions: int | None, model: str) -> torch.Tensor:
        """Matryoshka models keep the first `dimensions` components, renormalized."""
        if dimensions is None:
            return vectors
        allowed = self.engine.info.pooler.matryoshka_dimensions
        if allowed is None:
            raise OpenAIError(f'Model "{model}" does not support matryoshka representation, '
                              "changing output dimensions will lead to poor results.",
                              param="dimensions")
        if dimensions not in allowed:
            raise OpenAIError(f'Model "{model}" only supports {allowed} matryoshka dimensions, '
                              "using other output dimensions will lead to poor results.",
                              param="dimensions")
        return F.normalize(vectors[:, :dimensions], dim=-1)

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        model = self.check_model(request.model)
        self.check_priority(request.priority)
        ids = await self.tokenize(request.input, request.truncate_prompt_tokens,
                                  request.add_special_tokens)
        vectors = self._resize(await self.engine.embed(ids), request.dimensions, model)
        data = [EmbeddingData(index=i, embedding=_encode(vector, request.encoding_format))
                for i, vector in enumerate(vectors)]
        tokens = sum(len(t) for t in ids)
        return EmbeddingResponse(model=model, data=data,
                                 usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))

    async def _similarities(self, queries: list[str], documents: list[str],
                            truncate: int | None) -> tuple[list[float], int]:
        """Cosine of each (query, document) pair, and the tokens it took."""
        ids = await self.tokenize(queries + documents, truncate)
        vectors = await self.engine.embed(ids)
        left, right = vectors[:len(queries)], vectors[len(queries):]
        if len(queries) == 1:
            left = left.expand(len(documents), -1)
        scores = F.cosine_similarity(left, right, dim=-1)
        return scores.tolist(), sum(len(t) for t in ids)

    async def create_score(self, request: ScoreRequest) -> ScoreResponse:
        model = self.check_model(request.model)
        self.check_priority(request.priority)
        first = [request.text_1] if isinstance(request.text_1, str) else request.text_1
        second = [request.text_2] if isinstance(request.text_2, str) else request.text_2
        if not first or not second:
            raise OpenAIError("text_1 and text_2 must not be empty.", param="text_1")
        if len(first) != 1 and len(first) != len(second):
            raise OpenAIError("text_1 must be a string, a list of one, or a list as long as "
                              f"text_2 ({len(first)} and {len(second)} given).", param="text_1")
        scores, tokens = await self._similarities(first, second, request.truncate_prompt_tokens)
        return ScoreResponse(model=model,
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))

    async def create_rerank(self, request: RerankRequest) -> RerankResponse:
        model = self.check_model(request.model)
        self.check_priority(request.priority)
        scores, tokens = await self._similarities([request.query], request.documents,
                                                  request.truncate_prompt_tokens)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if request.top_n:
            order = order[:request.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=(RerankDocument(text=request.documents[i])
                                          if request.return_documents else None))
                   for i in order]
        return RerankResponse(model=model, usage=RerankUsage(total_tokens=tokens),
                              results=results)


def _encode(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """base64: the little-endian float32 bytes, as OpenAI and vLLM send them."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()

