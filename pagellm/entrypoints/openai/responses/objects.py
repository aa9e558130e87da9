"""The `response` object and its output items, as OpenAI's Responses API returns them."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from pagellm.entrypoints.openai.protocol import OpenAIBaseModel

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list)


class MessageOutput(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallOutput(OpenAIBaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: ItemStatus = "in_progress"


class ReasoningPart(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class ReasoningOutput(OpenAIBaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningPart] = Field(default_factory=list)
    status: ItemStatus = "in_progress"


OutputItem = MessageOutput | FunctionCallOutput | ReasoningOutput


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0  # read from the prefix cache
    cache_write_tokens: int = 0  # newly kept there (whole KV blocks only)


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(OpenAIBaseModel):
    code: str
    message: str


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    previous_response_id: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = True
    background: bool = False
    truncation: Literal["disabled"] = "disabled"
    reasoning: dict[str, Any] | None = None
    service_tier: str = "default"
    user: str | None = None
    usage: ResponseUsage | None = None

    @property
    def output_text(self) -> str:
        return "".join(part.text for item in self.output if isinstance(item, MessageOutput)
                       for part in item.content)
