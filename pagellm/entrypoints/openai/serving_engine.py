"""What completions and chat completions share: checks, engine calls, streaming, usage.

A request becomes one engine request ("job") per prompt; each job samples `n`
sequences. The engine yields delta outputs, one per step per job; a stream
turns each into exactly one SSE chunk, a non-streamed request accumulates them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel

from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.input_processor import ProcessedPrompt
from pagellm.engine.tokenizer_pool import PromptTooLong
from pagellm.entrypoints.openai.errors import OpenAIError, stream_error_event
from pagellm.entrypoints.openai.protocol import ChatMessageParam, SamplingRequest, UsageInfo
from pagellm.entrypoints.openai.structured import resolve_constraint
from pagellm.logger import init_logger
from pagellm.lora.request import LoRARequest
from pagellm.entrypoints.openai.response_models import PromptLogprob, PromptLogprobsBody
from pagellm.outputs import Logprob, PromptLogprobs, RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.structured_outputs.params import StructuredOutputsParams

logger = init_logger(__name__)

_RESERVED_TEMPLATE_KWARGS = {"messages", "chat_template", "add_generation_prompt", "tokenize"}

# A chunk formatter: (job index, delta output) -> the SSE chunk for that engine step.
ChunkMaker = Callable[[int, RequestOutput], BaseModel | None]


@dataclass
class Job:
    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    lora_request: LoRARequest | None = None  # the adapter `model` names
    prompt_logprobs: PromptLogprobs | None = None  # from its first output, once collected
    scores_only: bool = False  # completions' echo with max_tokens 0: its one token is dropped
    first_token_text: str = ""  # echo with logprobs: the prompt's first token, unscored


@dataclass
class SequenceResult:
    """One generated sequence, accumulated from its deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, text: str, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None,
            finish_reason: str | None, stop_reason: int | str | None) -> None:
        self.text += text
        self.token_ids += token_ids
        if logprobs is not None:
            self.logprobs = (self.logprobs or []) + logprobs
        self.finish_reason, self.stop_reason = finish_reason, stop_reason


@dataclass
class TokenLogprob:
    """A sampled token's text and logprob, with the `k` most likely alternatives."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


def token_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]],
                   num_top: int) -> list[TokenLogprob]:
    result = []
    for token_id, entries in zip(token_ids, logprobs):
        chosen = entries[token_id]
        ranked = sorted((e for e in entries.values() if e.rank is not None), key=lambda e: e.rank)
        top = [(e.decoded_token or "", e.logprob) for e in ranked[:num_top]]
        result.append(TokenLogprob(chosen.decoded_token or "", chosen.logprob, top))
    return result


# the logprob JSON carries for a token the float32 softmax underflowed for (vLLM's value)
LOWEST_LOGPROB = -9999.0


def prompt_logprobs_body(prompt_logprobs: PromptLogprobs | None) -> PromptLogprobsBody | None:
    if prompt_logprobs is None:
        return None
    return [None if entries is None else
            {token_id: PromptLogprob(logprob=max(entry.logprob, LOWEST_LOGPROB), rank=entry.rank,
                                     decoded_token=entry.decoded_token)
             for token_id, entry in entries.items()}
            for entries in prompt_logprobs]


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


async def merge_streams(streams: list[AsyncGenerator[RequestOutput, None]]
                        ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Items of several engine streams as they come, tagged with the stream's index.

    Leaving early (an error, a client gone) closes every stream, which aborts its request.
    """
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as stream:
            async for item in stream:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    queue.put_nowait((index, item))
            queue.put_nowait((index, None))
        except Exception as error:  # handed to the consumer, which re-raises it
            queue.put_nowait((index, error))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_names: list[str], log_requests: bool) -> None:
        self.engine = engine
        self.model_names = model_names
        self.log_requests = log_requests
        self.structured_outputs_config = engine.args.grammar_config()

    @property
    def max_model_len(self) -> int:
        return self.engine.info.max_model_len

    def check_model(self, model: str | None) -> str:
        """The served name (or LoRA adapter) the response carries; 404 for a model this
        server does not serve."""
        if model is None or model in self.model_names or model in self.engine.lora_adapters:
            return model or self.model_names[0]
        raise OpenAIError(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, "model")

    async def render_chat(self, messages: list[ChatMessageParam], add_generation_prompt: bool,
                          template_kwargs: dict[str, Any] | None,
                          limit: int | None = None) -> ProcessedPrompt:
        """Off the event loop for large conversations; past `limit` tokens, the context error."""
        if not messages:
            raise OpenAIError("messages must not be empty.", param="messages")
        template_kwargs = template_kwargs or {}
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & template_kwargs.keys())
        if reserved:
            raise OpenAIError(f"chat_template_kwargs may not set {reserved}.",
                              param="chat_template_kwargs")
        with self.context_checked():
            token_ids = await self.engine.encode_chat(
                [message.for_template() for message in messages], add_generation_prompt,
                limit, **template_kwargs)
        return ProcessedPrompt(None, token_ids)

    @contextlib.contextmanager
    def context_checked(self) -> Iterator[None]:
        """Turns a prompt the tokenizer found too long into vLLM's context-length error."""
        try:
            yield
        except PromptTooLong as error:
            self.resolve_max_tokens(error.num_tokens, None)
            raise

    def resolve_max_tokens(self, num_prompt_tokens: int, requested: int | None) -> int:
        """vLLM's context-length checks; None means "as many as the context leaves"."""
        limit = self.max_model_len
        if num_prompt_tokens == 0:
            raise OpenAIError("The prompt cannot be empty.", param="prompt")
        if num_prompt_tokens >= limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {num_prompt_tokens} input tokens. Please reduce the length of the input "
                "messages.")
        if requested is None:
            return limit - num_prompt_tokens
        if requested + num_prompt_tokens > limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{requested + num_prompt_tokens} tokens ({num_prompt_tokens} in the messages, "
                f"{requested} in the completion). Please reduce the length of the messages or "
                "completion.", param="max_tokens")
        return requested

    async def constraint(self, spec: dict[str, Any] | None,
                         backend: str | None = None) -> StructuredOutputsParams | None:
        """The validated structured-outputs spec (a 400 if the grammar library rejects it)."""
        return await resolve_constraint(spec, backend, self.structured_outputs_config)

    def make_job(self, request_id: str, prompt: ProcessedPrompt, request: SamplingRequest,
                 requested_max_tokens: int | None, num_logprobs: int | None,
                 structured: StructuredOutputsParams | None = None) -> Job:
        max_tokens = self.resolve_max_tokens(len(prompt.token_ids), requested_max_tokens)
        params = request.to_sampling_params(max_tokens, num_logprobs, structured)
        vocab_size = self.engine.info.vocab_size
        out_of_vocab = sorted(t for t in params.logit_bias or {} if not 0 <= t < vocab_size)
        if out_of_vocab:
            raise OpenAIError(f"token_id(s) {out_of_vocab} in logit_bias contain out-of-vocab "
                              f"token ids. Vocabulary size: {vocab_size}", param="logit_bias")
        if self.log_requests:
            logger.info("Received request %s: params: %s, prompt_token_ids: %s", request_id,
                        params, prompt.token_ids)
        return Job(request_id, prompt, params, self.engine.lora_adapters.get(request.model or ""))

    def generate_jobs(self, jobs: list[Job]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        return merge_streams([self.engine.generate(job.prompt, job.params, job.request_id,
                                                   job.lora_request) for job in jobs])

    async def collect(self, jobs: list[Job]) -> list[list[SequenceResult]]:
        """Run the jobs to the end; results[job][sequence index]."""
        results = [[SequenceResult() for _ in range(job.params.n)] for job in jobs]
        async with contextlib.aclosing(self.generate_jobs(jobs)) as outputs:
            async for job_index, output in outputs:
                if output.prompt_logprobs is not None:
                    jobs[job_index].prompt_logprobs = output.prompt_logprobs
                for completion in output.outputs:
                    results[job_index][completion.index].add(
                        completion.text, completion.token_ids, completion.logprobs,
                        completion.finish_reason, completion.stop_reason)
        return results

    @staticmethod
    def usage(jobs: list[Job], completion_tokens: int) -> UsageInfo:
        prompt_tokens = sum(len(job.prompt.token_ids) for job in jobs)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens)

    async def stream(self, jobs: list[Job], first_chunks: list[BaseModel], make_chunk: ChunkMaker,
                     usage_chunk: Callable[..., BaseModel] | None) -> AsyncIterator[str]:
        """Server-sent events: one chunk per engine step and job, then usage, then [DONE].

        `usage_chunk(usage=...)` makes the closing chunk that `stream_options.include_usage`
        asks for.
        """
        completion_tokens = 0
        try:
            for chunk in first_chunks:
                yield sse(chunk)
            async with contextlib.aclosing(self.generate_jobs(jobs)) as outputs:
                async for job_index, output in outputs:
                    completion_tokens += sum(len(c.token_ids) for c in output.outputs)
                    chunk = make_chunk(job_index, output)
                    if chunk is not None:
                        yield sse(chunk)
            if usage_chunk is not None:
                yield sse(usage_chunk(usage=self.usage(jobs, completion_tokens)))
        except Exception as error:  # the status line is sent: report in-band, as vLLM does
            yield stream_error_event(error)
        yield "data: [DONE]\n\n"
