"""Request bodies of the OpenAI-compatible API, with vLLM's extra fields, and what
every response shares (errors, usage, model cards); `response_models` has the answers.

Unknown request fields are ignored (as vLLM does), so clients written for newer
OpenAI schemas keep working; every known field is type-checked by pydantic, strictly:
`"prompt": [[false]]` or `"tokens": ["0"]` is a 400, never token id 0. Text must be
valid Unicode: a lone surrogate escape (`"\\ud800"`, valid JSON) is a 400 too.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagellm.sampling_params import SamplingParams
from pagellm.structured_outputs.params import StructuredOutputsParams


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def _lone_surrogate_path(value: Any, path: str) -> str | None:
    """Where in `value` (strings, lists, dicts) text that is not valid Unicode sits."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
    elif isinstance(value, dict):
        for key, item in value.items():
            found = _lone_surrogate_path(key, path) or _lone_surrogate_path(item, f"{path}.{key}")
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _lone_surrogate_path(item, f"{path}.{index}")
            if found:
                return found
    return None


class OpenAIRequestModel(OpenAIBaseModel):
    """A request body: no lax coercion (strict types) and only valid Unicode text."""

    model_config = ConfigDict(strict=True)

    @model_validator(mode="after")
    def _valid_unicode(self) -> "OpenAIRequestModel":
        for name, value in self.__dict__.items():
            if isinstance(value, BaseModel):
                continue  # validated on its own
            found = _lone_surrogate_path(value, name)
            if found:
                raise ValueError(f"{found} contains a lone UTF-16 surrogate, which is not valid "
                                 "Unicode text.")
        return self


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagellm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class StreamOptions(OpenAIRequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False

    @model_validator(mode="after")
    def _no_continuous_usage(self) -> "StreamOptions":
        if self.continuous_usage_stats:
            raise ValueError("stream_options.continuous_usage_stats is not supported.")
        return self


class JsonSchemaFormat(OpenAIBaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# Fields clients send that this server cannot honour: a 400 rather than silently dropped.
_UNSUPPORTED_FIELDS = ("audio", "prediction", "web_search_options", "functions",
                       "function_call")
_SERVICE_TIERS = (None, "auto", "default")


class SamplingRequest(OpenAIRequestModel):
    """Fields that completions and chat completions share (OpenAI's and vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # vLLM's: the top-k of every prompt token, and itself
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs, legacy guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # accepted as OpenAI's clients send them; nothing is stored, nothing is tiered
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true.")
        unsupported = [name for name in _UNSUPPORTED_FIELDS if getattr(self, name, None)]
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)} {'is' if len(unsupported) == 1 else 'are'}"
                             " not supported by this server.")
        if self.store:
            raise ValueError("store: true is not supported: this server keeps no completions.")
        if self.service_tier not in _SERVICE_TIERS:
            raise ValueError(f"service_tier {self.service_tier!r} is not supported; use 'auto' "
                             "or 'default'.")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def to_sampling_params(self, max_tokens: int, logprobs: int | None,
                           structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """Raises ValueError (a 400 for the client) on values SamplingParams rejects."""
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens,
            logprobs=logprobs, prompt_logprobs=self.num_prompt_logprobs,
            logit_bias=self._int_logit_bias(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            structured_outputs=structured)

    def _int_logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token): max(-100.0, min(100.0, bias))
                    for token, bias in self.logit_bias.items()}
        except ValueError as error:
            raise ValueError(f"logit_bias keys must be token ids: {error}") from None


class CompletionRequest(SamplingRequest):
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """`echo` with `logprobs` scores the prompt too, with as many alternatives (vLLM)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @property
    def scores_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt is scored, nothing is generated."""
        return self.echo and self.max_tokens == 0


class FunctionDefinition(OpenAIRequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(OpenAIRequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoiceFunction(OpenAIRequestModel):
    name: str


class NamedToolChoice(OpenAIRequestModel):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class TextContentPart(OpenAIRequestModel):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> "TextContentPart":
        if self.type != "text" or self.text is None:
            raise ValueError(f"only content parts of type 'text' are supported, got {self.type!r}")
        return self


class ChatMessageParam(OpenAIRequestModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None  # DeepSeek's name for `reasoning`

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: content parts joined into one string,
        each tool call's arguments a JSON string (OpenAI's form; a parsed object is accepted)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text or "" for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        extras = {"name": self.name, "tool_call_id": self.tool_call_id,
                  "tool_calls": _string_arguments(self.tool_calls),
                  "reasoning_content": self.reasoning or self.reasoning_content}
        message.update({key: value for key, value in extras.items() if value is not None})
        return message


def _string_arguments(tool_calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tool_calls:
        return tool_calls
    calls = []
    for call in tool_calls:
        function = dict(call.get("function") or {})
        if not isinstance(function.get("arguments", ""), str):
            function["arguments"] = json.dumps(function["arguments"], ensure_ascii=False)
        calls.append({**call, "function": function})
    return calls


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam]
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeCompletionRequest(OpenAIRequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(OpenAIRequestModel):
    model: str | None = None
    messages: list[ChatMessageParam]
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIRequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
