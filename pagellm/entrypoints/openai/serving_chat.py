"""`POST /v1/chat/completions`: the conversation through the chat template, then generation.

With `tools`, the answer is parsed into `tool_calls` by the server's tool-call parser
(`tool_choice: auto`), or constrained by structured outputs to a call (`required`, or a named
function) so that even a small model answers with a valid one.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from functools import partial

from pagellm.entrypoints.openai.chat_output import ChoiceOutput
from pagellm.entrypoints.openai.cli_args import ToolSettings
from pagellm.entrypoints.openai.errors import OpenAIError
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice
from pagellm.entrypoints.openai.response_models import (
    ChatCompletionChoice, ChatCompletionChunk, ChatCompletionLogProbs, ChatCompletionResponse,
    ChatCompletionStreamChoice, ChatLogProb, ChatLogProbsContent, ChatMessage, DeltaMessage)
from pagellm.entrypoints.openai.reasoning import reasoning_parser
from pagellm.entrypoints.openai.serving_engine import (Job, OpenAIServing, prompt_logprobs_body,
                                                       token_logprobs)
from pagellm.entrypoints.openai.structured import requested_constraint, tool_choice_constraint
from pagellm.entrypoints.openai.tool_parsers import ToolParserManager, parser_for_template
from pagellm.entrypoints.openai.tool_parsers.core import ToolParser
from pagellm.entrypoints.openai.tool_parsers.json_calls import NamedToolParser, RequiredToolParser
from pagellm.logger import init_logger
from pagellm.outputs import Logprob, RequestOutput

logger = init_logger(__name__)

AUTO_TOOL_CHOICE_ERROR = ('"auto" tool choice requires --enable-auto-tool-choice and '
                          '--tool-call-parser to be set')


@dataclass
class ChatPlan:
    """How one request's choices are parsed, and which finish_reason a call gets."""

    tool_parser: ToolParser | None
    max_calls: int | None
    calls_finish_reason: str
    constraint: dict | None

    def choice_output(self, reasoning: type | None) -> ChoiceOutput:
        return ChoiceOutput(reasoning() if reasoning else None, self.tool_parser, self.max_calls)

    def finish_reason(self, reason: str | None, output: ChoiceOutput) -> str | None:
        if reason in (None, "length") or not output.calls:
            return reason
        return self.calls_finish_reason


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]],
                  num_top: int) -> ChatCompletionLogProbs:
    content = [ChatLogProbsContent(
        token=entry.token, logprob=entry.logprob, bytes=list(entry.token.encode()),
        top_logprobs=[ChatLogProb(token=token, logprob=value, bytes=list(token.encode()))
                      for token, value in entry.top])
        for entry in token_logprobs(token_ids, logprobs, num_top)]
    return ChatCompletionLogProbs(content=content)


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, tools: ToolSettings | None = None) -> None:
        super().__init__(*args)
        self.tools = tools or ToolSettings()
        self.reasoning = reasoning_parser(self.tools.reasoning_parser)
        if self.tools.enable_auto_tool_choice and self.tools.tool_call_parser is None:
            self.tools.tool_call_parser = parser_for_template(self.engine.chat_template)
            if self.tools.tool_call_parser is None:
                raise ValueError("--enable-auto-tool-choice: the chat template shows no known "
                                 "tool-call format; set --tool-call-parser.")
            logger.info("Tool-call parser from the chat template: %s",
                        self.tools.tool_call_parser)
        if self.tools.tool_call_parser is not None:
            ToolParserManager.get(self.tools.tool_call_parser)  # an unknown name fails now

    def plan(self, request: ChatCompletionRequest) -> ChatPlan:
        """tool_choice -> parser, constraint and finish_reason (OpenAI's table)."""
        choice = request.tool_choice
        if not request.tools:
            if choice not in (None, "none"):
                raise OpenAIError("tool_choice needs tools.", param="tool_choice")
            return ChatPlan(None, None, "stop", requested_constraint(request))
        choice = choice or "auto"
        max_calls = None if request.parallel_tool_calls else 1
        constraint = tool_choice_constraint(request.tools, choice)
        if constraint is not None and requested_constraint(request) is not None:
            raise OpenAIError("response_format (or structured_outputs) cannot be combined "
                              f"with tool_choice {choice if isinstance(choice, str) else 'named'}.",
                              param="tool_choice")
        if isinstance(choice, NamedToolChoice):
            return ChatPlan(NamedToolParser(choice.function.name), 1, "stop", constraint)
        if choice == "required":
            return ChatPlan(RequiredToolParser(), max_calls, "tool_calls", constraint)
        if choice == "none":
            return ChatPlan(None, None, "stop", requested_constraint(request))
        if not self.tools.enable_auto_tool_choice or self.tools.tool_call_parser is None:
            raise OpenAIError(AUTO_TOOL_CHOICE_ERROR, param="tool_choice")
        parser = ToolParserManager.get(self.tools.tool_call_parser)()
        if parser.keeps_special_tokens:
            request.skip_special_tokens = False
        return ChatPlan(parser, max_calls, "tool_calls", requested_constraint(request))

    async def prepare(self, request: ChatCompletionRequest, request_id: str
                      ) -> tuple[ChatPlan, Job]:
        """The request's parsing plan and its one engine job (a 400 for what cannot run)."""
        num_logprobs = request.num_logprobs
        plan = self.plan(request)
        structured = await self.constraint(plan.constraint, request.guided_decoding_backend)
        kwargs = dict(request.chat_template_kwargs or {})
        if request.tools:
            kwargs.setdefault("tools", [tool.model_dump(exclude_none=True)
                                        for tool in request.tools])
        prompt = await self.render_chat(request.messages, request.add_generation_prompt, kwargs,
                                        self.max_model_len)
        return plan, self.make_job(request_id, prompt, request, request.requested_max_tokens,
                                   num_logprobs, structured)

    async def create_chat_completion(self, request: ChatCompletionRequest
                                     ) -> ChatCompletionResponse | AsyncIterator[str]:
        model = self.check_model(request.model)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        plan, job = await self.prepare(request, request_id)
        jobs = [job]
        outputs = [plan.choice_output(self.reasoning) for _ in range(request.n)]
        if request.stream:
            role_chunk = ChatCompletionChunk(id=request_id, model=model, choices=[
                ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                       content=""))
                for i in range(request.n)])
            usage_chunk = (partial(ChatCompletionChunk, id=request_id, model=model, choices=[])
                           if request.include_usage else None)
            make_chunk = partial(self._chunk, request_id, model, request.top_logprobs or 0,
                                 plan, outputs)
            return self.stream(jobs, [role_chunk], make_chunk, usage_chunk)
        results = (await self.collect(jobs))[0]
        choices = []
        for index, result in enumerate(results):
            output = outputs[index]
            output.feed(result.text, final=True)
            choices.append(ChatCompletionChoice(
                index=index, message=self._message(output),
                logprobs=(chat_logprobs(result.token_ids, result.logprobs,
                                        request.top_logprobs or 0)
                          if result.logprobs is not None else None),
                finish_reason=plan.finish_reason(result.finish_reason, output),
                stop_reason=result.stop_reason))
        return ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                      usage=self.usage(jobs, sum(len(r.token_ids)
                                                                 for r in results)),
                                      prompt_logprobs=prompt_logprobs_body(job.prompt_logprobs))

    @staticmethod
    def _message(output: ChoiceOutput) -> ChatMessage:
        content = output.sent_content
        reasoning = output.reasoning or None
        return ChatMessage(content=None if output.calls and not content else content,
                           tool_calls=output.tool_calls, reasoning=reasoning,
                           reasoning_content=reasoning)

    @staticmethod
    def _chunk(request_id: str, model: str, num_top: int, plan: ChatPlan,
               outputs: list[ChoiceOutput], _: int,
               output: RequestOutput) -> ChatCompletionChunk | None:
        choices = []
        for completion in output.outputs:
            logprobs = None
            if completion.logprobs:
                logprobs = chat_logprobs(completion.token_ids, completion.logprobs, num_top)
            state = outputs[completion.index]
            delta = state.feed(completion.text, final=completion.finish_reason is not None)
            message = DeltaMessage(content=delta.content or None,
                                   reasoning=delta.reasoning or None,
                                   reasoning_content=delta.reasoning or None,
                                   tool_calls=delta.tool_calls or None)
            finish_reason = plan.finish_reason(completion.finish_reason, state)
            if delta.content or delta.reasoning or delta.tool_calls or finish_reason or logprobs:
                choices.append(ChatCompletionStreamChoice(
                    index=completion.index, delta=message, logprobs=logprobs,
                    finish_reason=finish_reason, stop_reason=completion.stop_reason))
        if not choices and output.prompt_logprobs is None:
            return None
        return ChatCompletionChunk(id=request_id, model=model, choices=choices,
                                   prompt_logprobs=prompt_logprobs_body(output.prompt_logprobs))
