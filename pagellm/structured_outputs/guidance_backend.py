"""The llguidance backend: no ahead-of-time mask precompute, so compiling is near instant;
masks cost tens of microseconds per token on this CPU, and it covers more JSON Schema."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import torch

from pagellm.structured_outputs.backend import (GrammarBackend, choice_literals, is_ebnf,
                                                library_message)
from pagellm.structured_outputs.params import StructuredOutputsConfig, StructuredOutputsParams


class _Matcher:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Into the row of a contiguous CPU int32 bitmask (llguidance.torch's helper would
        import torch._dynamo: seconds at the first request)."""
        row_bytes = bitmask.shape[1] * bitmask.element_size()
        self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * row_bytes, row_bytes)

    @staticmethod
    def fill_many(matchers: Sequence["_Matcher"], bitmask: torch.Tensor, rows: list[int]) -> None:
        for matcher, row in zip(matchers, rows):
            matcher.fill_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()

    def fork(self) -> "_Matcher":
        return _Matcher(self._matcher.deep_copy())


class _Compiled:
    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self._tokenizer, self._grammar = tokenizer, grammar

    def matcher(self) -> _Matcher:
        return _Matcher(llguidance.LLMatcher(self._tokenizer, self._grammar))


def _grammar(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> str:
    kind = params.kind
    if kind == "json" or kind == "json_object":
        schema = params.json if kind == "json" else {"type": "object"}
        options: dict[str, Any] = {"whitespace_flexible": False}
        if GrammarBackend.any_whitespace(params, config):
            options = {"whitespace_pattern": f"[\\x20\\n\\t]{{0,{config.max_whitespace}}}"}
        if config.disable_additional_properties and isinstance(schema, dict):
            schema = {"additionalProperties": False, **schema}
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                             defaults=options)
    if kind == "regex":
        return llguidance.grammar_from("regex", params.regex)
    if kind == "choice":
        return llguidance.grammar_from("lark", f"start: {choice_literals(params.choice)}")
    return llguidance.grammar_from("gbnf" if is_ebnf(params.grammar) else "lark",
                                   params.grammar)


class _ByteTokenizer:
    """llguidance's view of a tokenizer that lists each token's bytes (mistral-common's,
    pagellm.mistral.tokenizer) instead of being an HF fast tokenizer."""

    def __init__(self, tokenizer: Any, eos_token_id: int | None) -> None:
        self._tokenizer = tokenizer
        self.tokens = tokenizer.token_bytes()
        self.eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_ids)

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_id: int | None
                 ) -> llguidance.LLTokenizer:
    if getattr(tokenizer, "token_bytes", None) is None:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(
        _ByteTokenizer(tokenizer, eos_token_id)), n_vocab=vocab_size)


class GuidanceBackend(GrammarBackend):
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 config: StructuredOutputsConfig) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids, config)
        self._tokenizer = ll_tokenizer(tokenizer, vocab_size,
                                       stop_token_ids[0] if stop_token_ids else None)

    @staticmethod
    def validate(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> None:
        try:
            message = llguidance.LLMatcher.validate_grammar(_grammar(params, config))
        except (RuntimeError, ValueError, TypeError) as error:
            message = library_message(error)
        if message:
            raise ValueError(f"invalid {params.kind} for structured outputs: "
                             f"{message.strip().splitlines()[0]}")

    def compile(self, params: StructuredOutputsParams) -> _Compiled:
        return _Compiled(self._tokenizer, _grammar(params, self.config))
