"""Structured outputs in the engine process: grammars compile on a thread pool, off the step
loop, and are cached by spec; each constrained sequence walks its own matcher.

A request waits (the scheduler skips it, the batch runs on) until its grammar is compiled.
A compilation that fails or outlives `compile_timeout_s` finishes the request as aborted;
specs are validated in the API process first, so this is the rare case.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch

from pagellm.logger import init_logger
from pagellm.structured_outputs.backend import (CompiledGrammar, GrammarBackend, GrammarMatcher,
                                                backend_class, choose_backend)
from pagellm.structured_outputs.params import StructuredOutputsConfig, StructuredOutputsParams

if TYPE_CHECKING:
    from pagellm.model.text import ModelText
    from pagellm.request import Request

logger = init_logger(__name__)
_CACHE_ENTRIES = 512
_IDLE_WAIT_S = 0.005


class RequestGrammar:
    """One sequence's constraint: the shared compilation, then a matcher of its own."""

    def __init__(self, compiled: Future[CompiledGrammar], deadline: float,
                 matcher: GrammarMatcher | None = None) -> None:
        self.compiled = compiled
        self.deadline = deadline
        self.matcher = matcher

    @property
    def ready(self) -> bool:
        if self.matcher is None and self.compiled.done() and self.compiled.exception() is None:
            self.matcher = self.compiled.result().matcher()
        return self.matcher is not None

    def failure(self, now: float) -> str | None:
        """Why this grammar will never be ready, or None while it may still be."""
        if self.compiled.done():
            error = self.compiled.exception()
            return None if error is None else f"grammar compilation failed: {error}"
        return "grammar compilation timed out" if now > self.deadline else None

    @property
    def active(self) -> bool:
        """Still constraining: compiled and not yet at its end."""
        return self.matcher is not None and not self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_bitmask(bitmask, row)

    def accept(self, token_id: int) -> None:
        if self.active and not self.matcher.accept(token_id):
            logger.error("Structured outputs: the sampled token %d does not match the grammar",
                         token_id)

    def fork(self) -> "RequestGrammar":
        """A sibling (n > 1) at the same point of the grammar, walking on its own."""
        return RequestGrammar(self.compiled, self.deadline,
                              self.matcher.fork() if self.matcher is not None else None)


def fill_bitmasks(grammars: Sequence[Any], bitmask: torch.Tensor) -> None:
    """Row i of `bitmask` from grammars[i]: the matchers of one library in one call (xgrammar
    fills them all natively); anything else with a `fill_bitmask(bitmask, row)` row by row."""
    groups: dict[type, tuple[list[GrammarMatcher], list[int]]] = {}
    for row, grammar in enumerate(grammars):
        if not isinstance(grammar, RequestGrammar):
            grammar.fill_bitmask(bitmask, row)
            continue
        matchers, rows = groups.setdefault(type(grammar.matcher), ([], []))
        matchers.append(grammar.matcher)
        rows.append(row)
    for kind, (matchers, rows) in groups.items():
        kind.fill_many(matchers, bitmask, rows)


class StructuredOutputManager:
    def __init__(self, model_text: Callable[[], ModelText], vocab_size: int,
                 config: StructuredOutputsConfig | None = None) -> None:
        """`model_text`: the tokenizer and stop tokens, asked for by the first grammar (an
        engine core behind an API server loads no tokenizer before)."""
        self.config = config or StructuredOutputsConfig()
        self._model_text = model_text
        self._vocab_size = vocab_size
        self._backends: dict[str, GrammarBackend] = {}
        self._cache: OrderedDict[tuple, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) // 2),
                                            thread_name_prefix="grammar-compile")

    def attach(self, request: "Request") -> None:
        """Start (or reuse) the compilation of the request's grammar."""
        params: StructuredOutputsParams = request.sampling_params.structured_outputs
        backend = params.backend or choose_backend(params, self.config)
        key = (backend, *params.key)
        with self._lock:
            future = self._cache.get(key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._executor.submit(self._compile, backend, params)
                self._cache[key] = future
                if len(self._cache) > _CACHE_ENTRIES:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
        request.grammar = RequestGrammar(future, time.monotonic() + self.config.compile_timeout_s)

    def _backend(self, name: str) -> GrammarBackend:
        with self._lock:
            backend = self._backends.get(name)
        # Built by the first request that needs it (its import and the tokenizer's tables
        # take about half a second, once), as vLLM does. Warmed up in a thread instead, the
        # library held the GIL and the import locks: while the engine loaded, it stalled the
        # load by a second; once ready, the first requests.
        if backend is None:
            text = self._model_text()
            backend = backend_class(name)(text.tokenizer, self._vocab_size,
                                          list(text.eos_token_ids), self.config)
            with self._lock:
                backend = self._backends.setdefault(name, backend)
        return backend

    def _compile(self, backend_name: str, params: StructuredOutputsParams) -> CompiledGrammar:
        start = time.perf_counter()
        compiled = self._backend(backend_name).compile(params)
        logger.debug("Compiled a %s grammar with %s in %.1f ms", params.kind, backend_name,
                     (time.perf_counter() - start) * 1e3)
        return compiled

    @staticmethod
    def wait_for_any(requests: list["Request"]) -> None:
        """Block briefly until one pending grammar is done, instead of spinning the loop."""
        pending = [r.grammar.compiled for r in requests
                   if r.grammar is not None and not r.grammar.compiled.done()]
        if pending:
            wait(pending, timeout=_IDLE_WAIT_S, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
