"""`POST /v1/completions`: one engine request per prompt, `n` sequences each."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from functools import partial

from pagellm.engine.input_processor import ProcessedPrompt
from pagellm.entrypoints.openai.errors import OpenAIError
from pagellm.entrypoints.openai.protocol import CompletionRequest
from pagellm.entrypoints.openai.response_models import (CompletionChoice, CompletionLogProbs,
                                                        CompletionResponse)
from pagellm.entrypoints.openai.serving_engine import (Job, OpenAIServing, SequenceResult,
                                                       token_logprobs)
from pagellm.entrypoints.openai.structured import requested_constraint
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput


class _CompletionChunker:
    """Turns one delta output into one stream chunk; remembers what each choice has sent."""

    def __init__(self, serving: "OpenAIServingCompletion", request: CompletionRequest,
                 request_id: str, model: str, jobs: list[Job]) -> None:
        self.serving, self.request, self.jobs = serving, request, jobs
        self.request_id, self.model = request_id, model
        self.sent_chars: dict[int, int] = {}

    def __call__(self, job_index: int, output: RequestOutput) -> CompletionResponse | None:
        choices = []
        for completion in output.outputs:
            index = job_index * self.request.n + completion.index
            text = completion.text
            if self.request.echo and index not in self.sent_chars:
                text = self.serving.prompt_text(self.jobs[job_index].prompt) + text
            choice = self.serving.make_choice(self.request, index, text, completion,
                                              self.sent_chars.get(index, 0))
            self.sent_chars[index] = self.sent_chars.get(index, 0) + len(text)
            if text or choice.finish_reason or choice.logprobs:
                choices.append(choice)
        if not choices:
            return None
        return CompletionResponse(id=self.request_id, model=self.model, choices=choices)


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest
                                ) -> CompletionResponse | AsyncIterator[str]:
        model = self.check_model(request.model)
        if request.suffix is not None:
            raise OpenAIError("suffix is not supported by this server.", param="suffix")
        if request.echo and request.logprobs is not None:
            raise OpenAIError("echo together with logprobs is not supported (prompt logprobs "
                              "are not computed).", param="echo")
        structured = await self.constraint(requested_constraint(request),
                                           request.guided_decoding_backend)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        jobs = [self.make_job(f"{request_id}-{i}", prompt, request, request.max_tokens,
                              request.logprobs, structured)
                for i, prompt in enumerate(await self._prompts(request.prompt))]
        if request.echo:
            await self._decode_prompts(jobs)
        if request.stream:
            usage_chunk = (partial(CompletionResponse, id=request_id, model=model, choices=[])
                           if request.include_usage else None)
            return self.stream(jobs, [], _CompletionChunker(self, request, request_id, model, jobs),
                               usage_chunk)
        results = await self.collect(jobs)
        choices = []
        for job_index, (job, sequences) in enumerate(zip(jobs, results)):
            prefix = self.prompt_text(job.prompt) if request.echo else ""
            choices += [self.make_choice(request, job_index * request.n + seq_index,
                                         prefix + result.text, result, 0)
                        for seq_index, result in enumerate(sequences)]
        completion_tokens = sum(len(r.token_ids) for sequences in results for r in sequences)
        return CompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=self.usage(jobs, completion_tokens))

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

    async def _decode_prompts(self, jobs: list[Job]) -> None:
        """`echo` repeats the prompt: the text of token-id prompts, decoded once, off the loop."""
        for job in jobs:
            if job.prompt.text is None:
                job.prompt.text = await self.engine.decode(job.prompt.token_ids)

    @staticmethod
    def prompt_text(prompt: ProcessedPrompt) -> str:
        return prompt.text or ""

    def make_choice(self, request: CompletionRequest, index: int, text: str,
                    sequence: CompletionOutput | SequenceResult,
                    text_offset: int) -> CompletionChoice:
        logprobs = None
        if sequence.logprobs is not None:
            logprobs = self.completion_logprobs(sequence.token_ids, sequence.logprobs,
                                                request.logprobs or 0, text_offset)
        return CompletionChoice(index=index, text=text, logprobs=logprobs,
                                finish_reason=sequence.finish_reason,
                                stop_reason=sequence.stop_reason)

    @staticmethod
    def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]],
                            num_top: int, text_offset: int) -> CompletionLogProbs:
        result = CompletionLogProbs()
        for entry in token_logprobs(token_ids, logprobs, num_top):
            result.tokens.append(entry.token)
            result.token_logprobs.append(entry.logprob)
            result.top_logprobs.append({**dict(entry.top), entry.token: entry.logprob})
            result.text_offset.append(text_offset)
            text_offset += len(entry.token)
        return result
