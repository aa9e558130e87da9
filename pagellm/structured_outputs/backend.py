"""One interface over the grammar libraries: compile a spec for the model's vocabulary, then
walk one matcher per sequence, which fills that sequence's row of the token bitmask.

A bitmask row has ceil(vocab / 32) int32 words; bit j of word i allows token 32 * i + j.
`validate` runs in the API process without a tokenizer (it is cheap: the grammar is parsed,
not compiled against the vocabulary), so a bad spec is a 400 before the engine sees it.
"""

from __future__ import annotations

import json
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pagellm.structured_outputs.params import StructuredOutputsConfig, StructuredOutputsParams

if TYPE_CHECKING:  # the API server validates specs without importing torch
    import torch

_LIBRARY_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarMatcher(Protocol):
    def accept(self, token_id: int) -> bool: ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    @staticmethod
    def fill_many(matchers: Sequence["GrammarMatcher"], bitmask: torch.Tensor,
                  rows: list[int]) -> None:
        """Row rows[i] of `bitmask` from matchers[i] (all of this class)."""

    def is_terminated(self) -> bool: ...

    def fork(self) -> "GrammarMatcher": ...


class CompiledGrammar(Protocol):
    def matcher(self) -> GrammarMatcher: ...


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def library_message(error: Exception) -> str:
    """The library's message without its timestamp and source location."""
    return _LIBRARY_PREFIX.sub("", str(error).strip().splitlines()[0] if str(error) else "")


def choice_literals(choices: list[str]) -> str:
    """`"a" | "b"`: JSON string escapes are valid in both EBNF and Lark literals."""
    return " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def is_ebnf(grammar: str) -> bool:
    return "::=" in grammar


class GrammarBackend(ABC):
    """A grammar library bound to one tokenizer; built lazily in the engine process."""

    name: str

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 config: StructuredOutputsConfig) -> None:
        self.vocab_size = vocab_size
        self.config = config

    @staticmethod
    @abstractmethod
    def validate(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> None:
        """Raise ValueError naming what is wrong with the spec."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar: ...

    @staticmethod
    def any_whitespace(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> bool:
        return not (params.disable_any_whitespace or config.disable_any_whitespace)


def import_backends_in_background() -> threading.Thread:
    """Import both grammar libraries on a daemon thread. xgrammar imports torch, 3 s on one
    core that an API server, which validates specs but never computes, would otherwise only
    spend on its first structured request (stalling its event loop); spent at start-up, they
    delayed `/health` as long. Started once the server listens: a structured request that
    comes sooner waits on the import lock for what is left."""
    def import_all() -> None:
        for name in ("xgrammar", "guidance"):
            backend_class(name)

    thread = threading.Thread(target=import_all, name="grammar-libraries", daemon=True)
    thread.start()
    return thread


def backend_class(name: str) -> type[GrammarBackend]:
    if name == "xgrammar":
        from pagellm.structured_outputs.xgrammar_backend import XGrammarBackend
        return XGrammarBackend
    if name == "guidance":
        from pagellm.structured_outputs.guidance_backend import GuidanceBackend
        return GuidanceBackend
    raise ValueError(f"unknown structured outputs backend {name!r}.")


def choose_backend(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> str:
    """Validate the spec; returns the backend that will compile it. `auto` tries xgrammar
    (faster masks) and falls back to guidance for specs xgrammar rejects (wider coverage)."""
    if config.backend != "auto":
        backend_class(config.backend).validate(params, config)
        return config.backend
    try:
        backend_class("xgrammar").validate(params, config)
        return "xgrammar"
    except ValueError as xgrammar_error:
        if config.disable_fallback:
            raise
        try:
            backend_class("guidance").validate(params, config)
        except ValueError:
            raise xgrammar_error from None
        return "guidance"
