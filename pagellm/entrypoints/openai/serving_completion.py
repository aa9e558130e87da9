"""`POST /v1/completions`: one engine request per prompt, `n` sequences each.

`echo` repeats the prompt before the completion; with `logprobs` the choice's logprobs
cover the prompt tokens first (the first one has none: `null`, as in OpenAI's legacy
completions), from the engine's prompt logprobs. `echo` with `max_tokens: 0` scores a
text without generating: the engine samples one token, which the answer leaves out (as
vLLM does), so that the choice ends with `length` and no completion tokens.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from functools import partial

from pagellm.engine.input_processor import ProcessedPrompt
from pagellm.entrypoints.openai.errors import OpenAIError
from pagellm.entrypoints.openai.protocol import CompletionRequest
from pagellm.entrypoints.openai.response_models import (CompletionChoice, CompletionLogProbs,
                                                        CompletionResponse)
from pagellm.entrypoints.openai.serving_engine import (LOWEST_LOGPROB, Job, OpenAIServing,
                                                       SequenceResult, prompt_logprobs_body,
                                                       token_logprobs)
from pagellm.entrypoints.openai.structured import requested_constraint
from pagellm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput


@dataclass
class _Echo:
    """The prompt a choice starts with, and its tokens' logprobs when asked for."""

    text: str
    logprobs: CompletionLogProbs | None = None


class _CompletionChunker:
    """Turns one delta output into one stream chunk; remembers what each choice has sent."""

    def __init__(self, serving: "OpenAIServingCompletion", request: CompletionRequest,
                 request_id: str, model: str, jobs: list[Job]) -> None:
        self.serving, self.request, self.jobs = serving, request, jobs
        self.request_id, self.model = request_id, model
        self.sent_chars: dict[int, int] = {}

    def __call__(self, job_index: int, output: RequestOutput) -> CompletionResponse | None:
        job = self.jobs[job_index]
        if output.prompt_logprobs is not None:
            job.prompt_logprobs = output.prompt_logprobs
        choices = []
        for completion in output.outputs:
            index = job_index * self.request.n + completion.index
            first = index not in self.sent_chars
            echo = self.serving.echo(self.request, job) if first and self.request.echo else None
            choice = self.serving.make_choice(self.request, index, completion,
                                              self.sent_chars.get(index, 0), echo,
                                              job.prompt_logprobs if first else None)
            self.sent_chars[index] = self.sent_chars.get(index, 0) + len(choice.text)
            if choice.text or choice.finish_reason or choice.logprobs:
                choices.append(choice)
        if not choices:
            return None
        return CompletionResponse(id=self.request_id, model=self.model, choices=choices)


def _without_tokens(completion: CompletionOutput) -> CompletionOutput:
    """A scoring request's output: its one sampled token left out, its end a `length`."""
    finish = completion.finish_reason
    return CompletionOutput(completion.index, "", [], None,
                            [] if completion.logprobs is not None else None,
                            None if finish is None else "abort" if finish == "abort" else "length")


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest
                                ) -> CompletionResponse | AsyncIterator[str]:
        model = self.check_model(request.model)
        if request.suffix is not None:
            raise OpenAIError("suffix is not supported by this server.", param="suffix")
        if request.max_tokens == 0 and not request.echo:
            raise OpenAIError("max_tokens: 0 is only allowed with echo: true, which scores the "
                              "prompt without generating.", param="max_tokens")
        structured = await self.constraint(requested_constraint(request),
                                           request.guided_decoding_backend)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        max_tokens = 1 if request.scores_only else request.max_tokens
        jobs = [self.make_job(f"{request_id}-{i}", prompt, request, max_tokens,
                              request.logprobs, structured)
                for i, prompt in enumerate(await self._prompts(request.prompt))]
        for job in jobs:
            job.scores_only = request.scores_only
        if request.echo:
            await self._decode_prompts(jobs, request.logprobs is not None)
        if request.stream:
            usage_chunk = (partial(CompletionResponse, id=request_id, model=model, choices=[])
                           if request.include_usage else None)
            return self.stream(jobs, [], _CompletionChunker(self, request, request_id, model, jobs),
                               usage_chunk)
        results = await self.collect(jobs)
        choices = []
        for job_index, (job, sequences) in enumerate(zip(jobs, results)):
            echo = self.echo(request, job) if request.echo else None
            choices += [self.make_choice(request, job_index * request.n + seq_index, result, 0,
                                         echo, job.prompt_logprobs)
                        for seq_index, result in enumerate(sequences)]
        completion_tokens = sum(len(r.token_ids) for sequences in results for r in sequences)
        return CompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=self.usage(jobs, completion_tokens))

    def generate_jobs(self, jobs: list[Job]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        outputs = super().generate_jobs(jobs)
        return self._scored_only(outputs) if any(job.scores_only for job in jobs) else outputs

    @staticmethod
    async def _scored_only(outputs: AsyncGenerator[tuple[int, RequestOutput], None]
                           ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        async with contextlib.aclosing(outputs) as stream:
            async for job_index, output in stream:
                output.outputs = [_without_tokens(c) for c in output.outputs]
                yield job_index, output

    async def _prompts(self, prompt: str | list[str] | list[int] | list[list[int]]
                       ) -> list[ProcessedPrompt]:
        single = isinstance(prompt, str) or (prompt and isinstance(prompt[0], int))
        prompts = [prompt] if single else list(prompt)
        if not prompts:
            raise OpenAIError("The prompt cannot be empty.", param="prompt")
        return [await self._prompt(p) for p in prompts]

    async def _prompt(self, prompt: str | list[int]) -> ProcessedPrompt:
        """Text is tokenized off the loop; too long a prompt is refused before any scan."""
        if isinstance(prompt, str):
            with self.context_checked():
                return ProcessedPrompt(prompt, await self.engine.encode(prompt,
                                                                        limit=self.max_model_len))
        self.resolve_max_tokens(len(prompt), None)
        return self.engine.input_processor.process_prompt(prompt)

    async def _decode_prompts(self, jobs: list[Job], with_logprobs: bool) -> None:
        """`echo` repeats the prompt: the text of token-id prompts, decoded once, off the loop,
        and with logprobs the text of the first token (which no prompt logprob entry has)."""
        for job in jobs:
            if job.prompt.text is None:
                job.prompt.text = await self.engine.decode(job.prompt.token_ids)
            if with_logprobs:
                job.first_token_text = await self.engine.decode(job.prompt.token_ids[:1])

    def echo(self, request: CompletionRequest, job: Job) -> _Echo:
        text = job.prompt.text or ""
        if request.logprobs is None or job.prompt_logprobs is None:
            return _Echo(text)
        return _Echo(text, self.prompt_token_logprobs(job.prompt.token_ids, job.prompt_logprobs,
                                                      job.first_token_text, request.logprobs))

    def make_choice(self, request: CompletionRequest, index: int,
                    sequence: CompletionOutput | SequenceResult, text_offset: int,
                    echo: _Echo | None = None,
                    prompt_logprobs: PromptLogprobs | None = None) -> CompletionChoice:
        """A choice's text (after the echoed prompt, if any) and its logprobs (the prompt's
        first); vLLM's `prompt_logprobs` where the engine computed them."""
        prefix = echo.text if echo is not None else ""
        logprobs = None
        if sequence.logprobs is not None:
            logprobs = self.completion_logprobs(sequence.token_ids, sequence.logprobs,
                                                request.logprobs or 0, text_offset + len(prefix))
            if echo is not None and echo.logprobs is not None:
                logprobs = _joined(echo.logprobs, logprobs)
        return CompletionChoice(index=index, text=prefix + sequence.text, logprobs=logprobs,
                                finish_reason=sequence.finish_reason,
                                stop_reason=sequence.stop_reason,
                                prompt_logprobs=prompt_logprobs_body(prompt_logprobs))

    @staticmethod
    def prompt_token_logprobs(token_ids: Sequence[int], prompt_logprobs: PromptLogprobs,
                              first_token: str, num_top: int) -> CompletionLogProbs:
        """The prompt's part of an echo's logprobs: `null` for the first token."""
        result = CompletionLogProbs(tokens=[first_token], token_logprobs=[None],
                                    top_logprobs=[None], text_offset=[0])
        scored = [entries for entries in prompt_logprobs[1:] if entries is not None]
        rest = OpenAIServingCompletion.completion_logprobs(token_ids[1:], scored, num_top,
                                                           len(first_token))
        return _joined(result, rest)

    @staticmethod
    def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]],
                            num_top: int, text_offset: int) -> CompletionLogProbs:
        result = CompletionLogProbs()
        for entry in token_logprobs(token_ids, logprobs, num_top):
            logprob = max(entry.logprob, LOWEST_LOGPROB)
            result.tokens.append(entry.token)
            result.token_logprobs.append(logprob)
            result.top_logprobs.append({**{token: max(value, LOWEST_LOGPROB)
                                           for token, value in entry.top},
                                        entry.token: logprob})
            result.text_offset.append(text_offset)
            text_offset += len(entry.token)
        return result


def _joined(first: CompletionLogProbs, second: CompletionLogProbs) -> CompletionLogProbs:
    return CompletionLogProbs(tokens=first.tokens + second.tokens,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              top_logprobs=first.top_logprobs + second.top_logprobs,
                              text_offset=first.text_offset + second.text_offset)
