"""Prompts to requests: tokenization and the checks that belong before the engine core."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pagellm.lora.request import LoRARequest
from pagellm.model.text import ModelText, TokenizerSpec
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


@dataclass
class ProcessedPrompt:
    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None


@dataclass
class ModelInfo:
    """What the front end needs to know of the model the engine core loaded."""

    max_model_len: int
    vocab_size: int
    model_type: str  # the family, for its chat template and EOS ids (pagellm.model.text)
    tokenizer_spec: TokenizerSpec
    num_kv_blocks: int = 0  # the first tier's, for the engine view's map before any step


class InputProcessor:
    def __init__(self, text: ModelText, info: ModelInfo) -> None:
        self.tokenizer = text.tokenizer
        self.eos_token_ids = text.eos_token_ids
        self.info = info

    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        if isinstance(prompt, dict):
            inner = prompt.get("prompt_token_ids", prompt.get("prompt"))
            processed = self.process_prompt(inner if isinstance(inner, str) else list(inner))
            processed.cache_salt = prompt.get("cache_salt")
            return processed
        if isinstance(prompt, str):
            return ProcessedPrompt(prompt, self.tokenizer.encode(prompt))
        token_ids = [int(t) for t in prompt]
        bad = [t for t in token_ids if not 0 <= t < self.info.vocab_size]
        if bad:
            raise ValueError(
                f"Token id {bad[0]} is out of vocabulary (size {self.info.vocab_size}).")
        return ProcessedPrompt(None, token_ids)

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """max_tokens=None means "up to the context length", as in vLLM."""
        max_model_len = self.info.max_model_len
        if num_prompt_tokens == 0:
            raise ValueError("The prompt cannot be empty.")
        if num_prompt_tokens >= max_model_len:
            raise ValueError(f"The decoder prompt (length {num_prompt_tokens}) is longer than "
                             f"the maximum model length of {max_model_len}.")
        room = max_model_len - num_prompt_tokens
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def with_extra_eos(self, params: SamplingParams) -> SamplingParams:
        """Models with several end tokens stop on all of them (unless ignore_eos)."""
        extra = [t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids]
        if not extra or params.ignore_eos:
            return params
        params = params.clone()
        params.stop_token_ids = params.stop_token_ids + extra
        return params

    def check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.info.vocab_size
        bad = [t for t in (params.logit_bias or {}) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias has token id {bad[0]} outside the vocabulary "
                             f"(size {vocab}).")

    def make_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                     arrival_time: float | None = None,
                     lora_request: LoRARequest | None = None) -> Request:
        self.check_token_ids(params)
        eos = self.eos_token_ids
        return Request(
            request_id=request_id, prompt_token_ids=prompt.token_ids,
            sampling_params=self.with_extra_eos(params),
            max_tokens=self.resolve_max_tokens(len(prompt.token_ids), params),
            eos_token_id=eos[0] if eos else None, cache_salt=prompt.cache_salt,
            lora_request=lora_request,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time)
