"""`POST /v1/chat/completions`: the conversation through the chat template, then generation."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from functools import partial

from pagellm.entrypoints.openai.protocol import (ChatCompletionChoice, ChatCompletionChunk,
                                                 ChatCompletionLogProbs, ChatCompletionRequest,
                                                 ChatCompletionResponse,
                                                 ChatCompletionStreamChoice, ChatLogProb,
                                                 ChatLogProbsContent, ChatMessage, DeltaMessage)
from pagellm.entrypoints.openai.serving_engine import OpenAIServing, token_logprobs
from pagellm.outputs import Logprob, RequestOutput


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]],
                  num_top: int) -> ChatCompletionLogProbs:
    content = [ChatLogProbsContent(
        token=entry.token, logprob=entry.logprob, bytes=list(entry.token.encode()),
        top_logprobs=[ChatLogProb(token=token, logprob=value, bytes=list(token.encode()))
                      for token, value in entry.top])
        for entry in token_logprobs(token_ids, logprobs, num_top)]
    return ChatCompletionLogProbs(content=content)


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest
                                     ) -> ChatCompletionResponse | AsyncIterator[str]:
        model = self.check_model(request.model)
        num_logprobs = request.num_logprobs
        prompt = await self.render_chat(request.messages, request.add_generation_prompt,
                                        request.chat_template_kwargs, self.max_model_len)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        jobs = [self.make_job(request_id, prompt, request, request.requested_max_tokens,
                              num_logprobs)]
        if request.stream:
            role_chunk = ChatCompletionChunk(id=request_id, model=model, choices=[
                ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                       content=""))
                for i in range(request.n)])
            usage_chunk = (partial(ChatCompletionChunk, id=request_id, model=model, choices=[])
                           if request.include_usage else None)
            make_chunk = partial(self._chunk, request_id, model, request.top_logprobs or 0)
            return self.stream(jobs, [role_chunk], make_chunk, usage_chunk)
        results = (await self.collect(jobs))[0]
        choices = [ChatCompletionChoice(
            index=index, message=ChatMessage(content=result.text),
            logprobs=(chat_logprobs(result.token_ids, result.logprobs, request.top_logprobs or 0)
                      if result.logprobs is not None else None),
            finish_reason=result.finish_reason, stop_reason=result.stop_reason)
            for index, result in enumerate(results)]
        return ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                      usage=self.usage(jobs, sum(len(r.token_ids)
                                                                 for r in results)))

    @staticmethod
    def _chunk(request_id: str, model: str, num_top: int, _: int,
               output: RequestOutput) -> ChatCompletionChunk | None:
        choices = []
        for completion in output.outputs:
            logprobs = None
            if completion.logprobs:
                logprobs = chat_logprobs(completion.token_ids, completion.logprobs, num_top)
            if completion.text or completion.finish_reason or logprobs:
                choices.append(ChatCompletionStreamChoice(
                    index=completion.index, delta=DeltaMessage(content=completion.text),
                    logprobs=logprobs, finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason))
        if not choices:
            return None
        return ChatCompletionChunk(id=request_id, model=model, choices=choices)
