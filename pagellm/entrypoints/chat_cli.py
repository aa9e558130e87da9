"""`pagellm chat`: a terminal chat with streamed replies.

With `--base-url` it talks to a running OpenAI-compatible server through the
`openai` SDK; without, it loads the model in this process. It reads one user
message per stdin line, so a conversation can be piped in.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Iterator
from typing import Any, Protocol

from pagellm.engine.arg_utils import EngineArgs
from pagellm.logger import log_to_stderr
from pagellm.entrypoints.openai.cli_args import API_KEY_ENV_VARS
from pagellm.sampling_params import OutputKind, SamplingParams

Messages = list[dict[str, Any]]


class ChatBackend(Protocol):
    def stream(self, messages: Messages) -> Iterator[str]: ...


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", "--url", default=None, metavar="URL",
                        help="a running server, e.g. http://localhost:8000/v1 (default: load the "
                             "model in this process)")
    parser.add_argument("--model-name", default=None,
                        help="model to ask the server for (default: the first it lists)")
    parser.add_argument("--api-key", default=None,
                        help=f"server API key (also env {', '.join(API_KEY_ENV_VARS)})")
    parser.add_argument("--system-prompt", default=None, help="a system message opening the chat")
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens per reply")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 for greedy")
    EngineArgs.add_cli_args(parser)


class RemoteChat:
    def __init__(self, args: argparse.Namespace) -> None:
        try:
            import openai
        except ImportError:
            raise ValueError("pagellm chat --base-url needs the `openai` package "
                             "(pip install openai).") from None
        api_key = args.api_key or next(
            (os.environ[name] for name in API_KEY_ENV_VARS if os.environ.get(name)), "EMPTY")
        self.client = openai.OpenAI(base_url=args.base_url, api_key=api_key)
        self.api_error = openai.APIError
        self.max_tokens, self.temperature = args.max_tokens, args.temperature
        try:
            self.model = args.model_name or self.client.models.list().data[0].id
        except openai.APIError as error:
            raise ValueError(f"cannot list the models of {args.base_url}: {error}") from None

    def stream(self, messages: Messages) -> Iterator[str]:
        try:
            chunks = self.client.chat.completions.create(
                model=self.model, messages=messages, stream=True, max_tokens=self.max_tokens,
                temperature=self.temperature)
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    yield chunk.choices[0].delta.content
        except self.api_error as error:
            raise ValueError(f"the server answered: {error}") from None


class LocalChat:
    def __init__(self, args: argparse.Namespace) -> None:
        from pagellm.engine.llm_engine import LLMEngine

        log_to_stderr()  # stdout carries the conversation only
        engine_args = EngineArgs.from_cli_args(args)
        self.engine = LLMEngine(engine_args)
        self.params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        self.ids = itertools.count()

    def stream(self, messages: Messages) -> Iterator[str]:
        prompt = self.engine.apply_chat_template(messages)
        self.engine.add_request(str(next(self.ids)), prompt, self.params, OutputKind.DELTA)
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                yield from (completion.text for completion in output.outputs if completion.text)


def converse(backend: ChatBackend, system_prompt: str | None) -> None:
    messages: Messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        reply = []
        for piece in backend.stream(messages):
            print(piece, end="", flush=True)
            reply.append(piece)
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(reply)})


def run(args: argparse.Namespace) -> None:
    backend: ChatBackend = RemoteChat(args) if args.base_url else LocalChat(args)
    converse(backend, args.system_prompt)
