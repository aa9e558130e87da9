"""The body of `POST /v1/responses`, and its translation into a chat conversation.

The Responses API carries the same conversation as chat completions in another shape:
`instructions` and `input` items (messages, function calls and their outputs, reasoning)
instead of `messages`, flat function tools, `text.format` instead of `response_format`.
Everything this server can honour is translated; anything else (built-in tools, images,
background runs, server-side truncation...) is a 400 naming the field, never dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from pagellm.entrypoints.openai.errors import OpenAIError
from pagellm.entrypoints.openai.protocol import OpenAIRequestModel

# The one `include` value that changes the answer here; others ask for what is not kept.
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class TextPart(OpenAIRequestModel):
    """A text content part of an input message (`output_text` in replayed assistant turns)."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(OpenAIRequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(OpenAIRequestModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(OpenAIRequestModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningText(OpenAIRequestModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(OpenAIRequestModel):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None

    @model_validator(mode="after")
    def _readable(self) -> "ReasoningItem":
        if self.encrypted_content is not None:
            raise ValueError("encrypted reasoning content is not supported.")
        return self

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or self.summary)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem, "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


class FunctionTool(OpenAIRequestModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description,
                    "parameters": self.parameters, "strict": self.strict}
        return {"type": "function",
                "function": {key: value for key, value in function.items() if value is not None}}


class TextFormat(OpenAIRequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def as_response_format(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.schema_ is None:
            raise ValueError("text.format of type json_schema needs a schema.")
        schema = {"name": self.name or "response", "schema": self.schema_, "strict": self.strict,
                  "description": self.description}
        return {"type": "json_schema",
                "json_schema": {key: value for key, value in schema.items() if value is not None}}


class TextConfig(OpenAIRequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # a knob of OpenAI's models: any value is a 400


class NamedFunction(OpenAIRequestModel):
    type: Literal["function"]
    name: str


class ReasoningConfig(OpenAIRequestModel):
    """Effort and summaries are knobs of OpenAI's reasoning models: any value is a 400."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(OpenAIRequestModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction = "auto"
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = Field(default=None, ge=1)
    text: TextConfig | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_output_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    background: bool | None = None
    seed: int | None = None

    @model_validator(mode="after")
    def _honoured(self) -> "ResponsesRequest":
        unknown = sorted(set(self.include or ()) - {LOGPROBS_INCLUDE})
        if unknown:
            raise ValueError(f"include values {unknown} are not supported by this server.")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true.")
        unsupported = {
            "background": self.background,
            "truncation: auto (dropping the start of the conversation)":
                self.truncation == "auto",
            "reasoning.effort and reasoning.summary": self.reasoning is not None and any(
                (self.reasoning.effort, self.reasoning.summary, self.reasoning.generate_summary)),
            "text.verbosity": self.text is not None and self.text.verbosity is not None}
        named = [name for name, asked in unsupported.items() if asked]
        if named:
            raise ValueError(f"{', '.join(named)}: not supported by this server.")
        return self

    @property
    def num_top_logprobs(self) -> int | None:
        if self.top_logprobs is not None:
            return self.top_logprobs
        return 0 if LOGPROBS_INCLUDE in (self.include or ()) else None

    def function_tools(self) -> list[FunctionTool]:
        tools = []
        for index, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise OpenAIError(f"tools[{index}]: tool type {tool.get('type')!r} is not "
                                  "supported by this server; only function tools are.",
                                  param=f"tools[{index}]")
            tools.append(_validated(FunctionTool, tool, f"tools[{index}]"))
        return tools

    def input_items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        items = []
        for index, raw in enumerate(self.input):
            kind = raw.get("type", "message")
            item_type = _ITEM_TYPES.get(kind)
            if item_type is None:
                raise OpenAIError(f"input[{index}]: item type {kind!r} is not supported by this "
                                  "server.", param=f"input[{index}]")
            items.append(_validated(item_type, raw, f"input[{index}]"))
        return items


def _validated(model: type, raw: dict[str, Any], where: str) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise OpenAIError(f"{where}{'.' + field if field else ''}: {first['msg']}",
                          param=where) from None


def chat_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls become one assistant turn
    with `tool_calls`, their outputs `tool` messages, reasoning the next assistant turn's."""
    messages: list[dict[str, Any]] = []
    reasoning = None
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = item.text
        elif isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            message: dict[str, Any] = {"role": role, "content": item.text}
            if role == "assistant" and reasoning is not None:
                message["reasoning"], reasoning = reasoning, None
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning"], reasoning = reasoning, None
                messages.append(message)
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return messages
