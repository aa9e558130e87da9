"""The xgrammar backend: precomputed token-mask caches, a few microseconds per token here."""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from pagellm.structured_outputs.backend import (GrammarBackend, choice_literals, is_ebnf,
                                                library_message)
from pagellm.structured_outputs.params import StructuredOutputsConfig, StructuredOutputsParams

_BATCH_LOCK = threading.Lock()


@functools.cache
def _batch_matcher() -> xgr.BatchGrammarMatcher:
    """Fills many rows in one native call, GIL released. One thread: the fill runs while the
    forward does (tens of microseconds a row against milliseconds of forward), and more
    threads would only take cores from it (xgrammar's default is half the machine's cores,
    not the engine's)."""
    return xgr.BatchGrammarMatcher(max_threads=1)


class _Matcher:
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    @staticmethod
    def fill_many(matchers: Sequence["_Matcher"], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Row rows[i] of `bitmask` from matchers[i]: no Python per row."""
        with _BATCH_LOCK:
            _batch_matcher().batch_fill_next_token_bitmask([m._matcher for m in matchers],
                                                           bitmask, rows)

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def fork(self) -> "_Matcher":
        return _Matcher(self._matcher.fork())


class _Compiled:
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._compiled = compiled

    def matcher(self) -> _Matcher:
        return _Matcher(xgr.GrammarMatcher(self._compiled))


def _grammar(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> xgr.Grammar:
    any_whitespace = GrammarBackend.any_whitespace(params, config)
    whitespace = {"any_whitespace": any_whitespace,
                  "max_whitespace_cnt": config.max_whitespace if any_whitespace else None}
    kind = params.kind
    if kind == "json" or kind == "json_object":
        schema = params.json if kind == "json" else {"type": "object"}
        return xgr.Grammar.from_json_schema(schema if isinstance(schema, dict) else {},
                                            **whitespace)
    if kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(f"root ::= {choice_literals(params.choice)}")
    if is_ebnf(params.grammar):
        return xgr.Grammar.from_ebnf(params.grammar)
    return xgr.Grammar.from_lark(params.grammar)


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]
                   ) -> xgr.TokenizerInfo:
    """From an HF tokenizer, or from the raw bytes of each token where the tokenizer lists
    them (mistral-common's, pagellm.mistral.tokenizer)."""
    token_bytes = getattr(tokenizer, "token_bytes", None)
    if token_bytes is None:
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids)
    return xgr.TokenizerInfo(token_bytes(), xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=stop_token_ids)


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 config: StructuredOutputsConfig) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids, config)
        info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)

    @staticmethod
    def validate(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> None:
        try:
            _grammar(params, config)
        except (RuntimeError, ValueError, TypeError) as error:
            raise ValueError(f"invalid {params.kind} for structured outputs: "
                             f"{library_message(error)}") from None

    def compile(self, params: StructuredOutputsParams) -> _Compiled:
        return _Compiled(self._compiler.compile_grammar(_grammar(params, self.config)))
