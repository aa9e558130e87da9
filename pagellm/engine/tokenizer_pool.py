"""Tokenization, chat templating and detokenization off the server's event loop.

Encoding 20 MB of text takes the tokenizer tens of seconds, much of it holding the GIL,
so a thread would still stall every other request. Large inputs go to a worker
process instead (the tokenizer travels there pickled); small ones, which cost less
than the hop, run in place. A prompt longer than the caller's limit comes back as its
length only, so the event loop never unpickles millions of token ids it would refuse.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import jinja2

from pagellm.logger import init_logger
from pagellm.tokenizer import apply_chat_template

logger = init_logger(__name__)

# Below this many characters (or token ids), the work takes under a millisecond or so.
INLINE_LIMIT = 16_384
WORKER_NICENESS = 10


class PromptTooLong(ValueError):
    """The input has `num_tokens` tokens, more than the caller's limit allowed."""

    def __init__(self, num_tokens: int) -> None:
        super().__init__(f"the input has {num_tokens} tokens")
        self.num_tokens = num_tokens


def _checked(token_ids: list[int], limit: int | None) -> list[int] | int:
    return len(token_ids) if limit is not None and len(token_ids) > limit else token_ids


def encode(tokenizer: Any, text: str, add_special_tokens: bool,
           limit: int | None) -> list[int] | int:
    return _checked(tokenizer.encode(text, add_special_tokens=add_special_tokens), limit)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], chat_template: str | None,
                add_generation_prompt: bool, template_kwargs: dict[str, Any],
                limit: int | None) -> list[int] | int:
    try:
        ids = apply_chat_template(tokenizer, messages, chat_template, add_generation_prompt,
                                  **template_kwargs)
    except jinja2.TemplateError as error:
        # Jinja's exceptions do not survive pickling; the message is what the client needs.
        raise ValueError(f"The chat template failed on these messages: {error}") from None
    return _checked(ids, limit)


def decode(tokenizer: Any, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids)


_worker_tokenizer: Any = None


def _init_worker(pickled_tokenizer: bytes) -> None:
    global _worker_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle
    # A huge input is one client's slow request: on a machine with as many cores as the engine
    # uses, the engine core's steps and the event loop must keep the CPU before it.
    os.nice(WORKER_NICENESS)
    _worker_tokenizer = pickle.loads(pickled_tokenizer)


def _in_worker(function: Any, *args: Any) -> Any:
    return function(_worker_tokenizer, *args)


class TokenizerPool:
    """Async tokenizer calls; one worker process, started on the first large input."""

    def __init__(self, tokenizer: Any, workers: int = 1) -> None:
        self.tokenizer = tokenizer
        self.workers = workers
        self._executor: ProcessPoolExecutor | None = None

    async def encode(self, text: str, add_special_tokens: bool = True,
                     limit: int | None = None) -> list[int]:
        """Raises PromptTooLong when the text has more than `limit` tokens."""
        return self._ids(await self._run(len(text), encode, text, add_special_tokens, limit))

    async def render_chat(self, messages: list[dict[str, Any]], chat_template: str | None,
                          add_generation_prompt: bool, template_kwargs: dict[str, Any],
                          limit: int | None = None) -> list[int]:
        size = sum(len(str(message.get("content") or "")) for message in messages)
        return self._ids(await self._run(size, render_chat, messages, chat_template,
                                         add_generation_prompt, template_kwargs, limit))

    async def decode(self, token_ids: list[int]) -> str:
        return await self._run(len(token_ids), decode, token_ids)

    @staticmethod
    def _ids(result: list[int] | int) -> list[int]:
        if isinstance(result, int):
            raise PromptTooLong(result)
        return result

    async def _run(self, size: int, function: Any, *args: Any) -> Any:
        if size <= INLINE_LIMIT:
            return function(self.tokenizer, *args)
        executor = self._start()
        try:
            # submitted from a thread: the first submit spawns the worker and writes it the
            # pickled tokenizer, which blocks until the new process has imported enough to
            # read it (seconds, measured as one 6.7 s /health stall under a body flood)
            future = await asyncio.to_thread(executor.submit, _in_worker, function, *args)
            return await asyncio.wrap_future(future)
        except BrokenProcessPool:
            logger.error("The tokenizer worker process died; starting a new one.")
            self._executor = None
            raise RuntimeError("the tokenizer worker process died during this request") from None

    def _start(self) -> ProcessPoolExecutor:
        if self._executor is None:
            self._executor = ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker, initargs=(pickle.dumps(self.tokenizer),))
        return self._executor

    def shutdown(self) -> None:
        """Ends the workers at once, even in the middle of a long input."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        # The executor has no public way to stop a busy worker before Python 3.14.
        for process in list(getattr(executor, "_processes", {}).values()):
            process.terminate()
        executor.shutdown(wait=True, cancel_futures=True)
