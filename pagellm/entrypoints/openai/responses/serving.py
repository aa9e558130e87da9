"""`/v1/responses`: OpenAI's Responses API over the chat-completions machinery.

A request is translated into a chat request (same template, tool-call parser, reasoning
parser and structured outputs), generated as one engine job, and built into a response
by `ResponseBuilder`. Stored responses carry their conversation, so `previous_response_id`
continues it without the client resending the history.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel

from pagellm.entrypoints.openai.chat_output import ChoiceDelta, ChoiceOutput
from pagellm.entrypoints.openai.errors import OpenAIError, to_openai_error
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.responses.events import Event, ResponseBuilder
from pagellm.entrypoints.openai.responses.objects import (InputTokensDetails, OutputTokensDetails,
                                                          ResponseObject, ResponseUsage,
                                                          TokenLogprob, TopLogprob)
from pagellm.entrypoints.openai.responses.protocol import ResponsesRequest, chat_messages
from pagellm.entrypoints.openai.responses.store import ResponseStore, StoredResponse
from pagellm.entrypoints.openai.serving_chat import ChatPlan, OpenAIServingChat
from pagellm.entrypoints.openai.serving_engine import Job, token_logprobs
from pagellm.outputs import CompletionOutput


class DeletedResponse(BaseModel):
    id: str
    object: str = "response.deleted"
    deleted: bool = True


def _sse(event: Event) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def _step_logprobs(completion: CompletionOutput, num_top: int) -> list[TokenLogprob]:
    if not completion.logprobs:
        return []
    return [TokenLogprob(token=entry.token, logprob=entry.logprob, bytes=list(entry.token.encode()),
                         top_logprobs=[TopLogprob(token=token, logprob=value,
                                                  bytes=list(token.encode()))
                                       for token, value in entry.top])
            for entry in token_logprobs(completion.token_ids, completion.logprobs, num_top)]


def _message_logprobs(delta: ChoiceDelta, pending: list[TokenLogprob]
                      ) -> tuple[list[TokenLogprob], list[TokenLogprob]]:
    """(logprobs that go with the delta's message text, those still waiting for their text).

    Tokens whose text went to reasoning or a tool call are not the message's."""
    if delta.content:
        return pending, []
    if delta.reasoning or delta.tool_calls:
        return [], []
    return [], pending


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    def _history(self, request: ResponsesRequest) -> list[dict[str, Any]]:
        if request.previous_response_id is None:
            return []
        previous = self.store.get(request.previous_response_id)
        if previous is None:
            raise OpenAIError(f"Previous response with id '{request.previous_response_id}' not "
                              "found.", param="previous_response_id")
        return previous.history

    def _chat_request(self, request: ResponsesRequest,
                      messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        text_format = request.text.format if request.text is not None else None
        tool_choice: Any = request.tool_choice
        if not isinstance(tool_choice, str):
            tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
        body = {"model": request.model, "messages": messages,
                "tools": [tool.as_chat_tool() for tool in request.function_tools()] or None,
                "tool_choice": tool_choice if request.tools or tool_choice != "auto" else None,
                "parallel_tool_calls": request.parallel_tool_calls,
                "max_completion_tokens": request.max_output_tokens,
                "temperature": request.temperature, "top_p": request.top_p, "seed": request.seed,
                "logprobs": request.num_top_logprobs is not None,
                "top_logprobs": request.num_top_logprobs, "user": request.user,
                "response_format": text_format.as_response_format() if text_format else None}
        return ChatCompletionRequest.model_validate(
            {key: value for key, value in body.items() if value is not None})

    def _skeleton(self, request: ResponsesRequest, response_id: str, model: str) -> ResponseObject:
        text_format = request.text.format if request.text and request.text.format else None
        return ResponseObject(
            id=response_id, model=model, instructions=request.instructions, tools=request.tools,
            tool_choice=(request.tool_choice if isinstance(request.tool_choice, str)
                         else request.tool_choice.model_dump()),
            parallel_tool_calls=request.parallel_tool_calls, max_tool_calls=request.max_tool_calls,
            max_output_tokens=request.max_output_tokens, temperature=request.temperature,
            top_p=request.top_p, top_logprobs=request.top_logprobs,
            text={"format": (text_format.model_dump(by_alias=True, exclude_none=True)
                             if text_format else {"type": "text"})},
            previous_response_id=request.previous_response_id, metadata=request.metadata or {},
            store=request.store, user=request.user)

    async def create(self, request: ResponsesRequest) -> ResponseObject | AsyncIterator[str]:
        model = self.chat.check_model(request.model)
        history = self._history(request)
        conversation = history + chat_messages(request.input_items())
        system = [{"role": "system", "content": request.instructions}] if request.instructions \
            else []
        chat_request = self._chat_request(request, system + conversation)
        response_id = f"resp_{uuid.uuid4().hex}"
        plan, job = await self.chat.prepare(chat_request, response_id)
        if request.max_tool_calls is not None:
            plan.max_calls = min(plan.max_calls or request.max_tool_calls, request.max_tool_calls)
        builder = ResponseBuilder(self._skeleton(request, response_id, model))
        events = self._events(builder, plan, job, request, conversation)
        if request.stream:
            return (_sse(event) async for event in events)
        async with contextlib.aclosing(events) as stream:
            async for _ in stream:
                pass
        if builder.response.status == "failed":
            raise OpenAIError(builder.response.error.message, HTTPStatus.INTERNAL_SERVER_ERROR)
        return builder.response

    async def _events(self, builder: ResponseBuilder, plan: ChatPlan, job: Job,
                      request: ResponsesRequest,
                      conversation: list[dict[str, Any]]) -> AsyncIterator[Event]:
        output = plan.choice_output(self.chat.reasoning)
        for event in builder.start():
            yield event
        finish_reason, output_tokens, reasoning_tokens, cached = None, 0, 0, 0
        pending: list[TokenLogprob] = []  # tokens whose text is held back (partial UTF-8...)
        try:
            async with contextlib.aclosing(self.chat.generate_jobs([job])) as steps:
                async for _, step in steps:
                    cached = step.num_cached_tokens
                    for completion in step.outputs:
                        delta = output.feed(completion.text,
                                            final=completion.finish_reason is not None)
                        output_tokens += len(completion.token_ids)
                        if delta.reasoning and not delta.content:
                            reasoning_tokens += len(completion.token_ids)
                        pending += _step_logprobs(completion, request.num_top_logprobs or 0)
                        logprobs, pending = _message_logprobs(delta, pending)
                        for event in builder.feed(delta, logprobs):
                            yield event
                        finish_reason = completion.finish_reason
        except Exception as error:  # the stream has started: a terminal event says why
            for event in builder.fail(to_openai_error(error).message):
                yield event
            return
        input_tokens = len(job.prompt.token_ids)
        usage = ResponseUsage(input_tokens=input_tokens,
                              input_tokens_details=self._cache_details(input_tokens, cached),
                              output_tokens=output_tokens,
                              output_tokens_details=OutputTokensDetails(
                                  reasoning_tokens=reasoning_tokens),
                              total_tokens=input_tokens + output_tokens)
        for event in builder.finish(plan.finish_reason(finish_reason, output), usage):
            yield event
        if request.store:
            self.store.put(StoredResponse(builder.response,
                                          conversation + [self._assistant_turn(output)]))

    def _cache_details(self, input_tokens: int, cached: int) -> InputTokensDetails:
        args = self.chat.engine.args
        if not args.enable_prefix_caching:
            return InputTokensDetails()
        whole_blocks = input_tokens // args.block_size * args.block_size
        return InputTokensDetails(cached_tokens=cached,
                                  cache_write_tokens=max(0, whole_blocks - cached))

    @staticmethod
    def _assistant_turn(output: ChoiceOutput) -> dict[str, Any]:
        turn: dict[str, Any] = {"role": "assistant", "content": output.sent_content or None}
        if output.calls:
            turn["tool_calls"] = [call.model_dump() for call in output.tool_calls]
        if output.reasoning:
            turn["reasoning"] = output.reasoning
        return turn

    def retrieve(self, response_id: str) -> ResponseObject:
        entry = self.store.get(response_id)
        if entry is None:
            raise OpenAIError(f"Response with id '{response_id}' not found.",
                              HTTPStatus.NOT_FOUND, "response_id")
        return entry.response

    def delete(self, response_id: str) -> DeletedResponse:
        if not self.store.delete(response_id):
            raise OpenAIError(f"Response with id '{response_id}' not found.",
                              HTTPStatus.NOT_FOUND, "response_id")
        return DeletedResponse(id=response_id)
