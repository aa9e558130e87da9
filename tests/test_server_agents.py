"""Tools, structured outputs and the OpenAI fields agent frameworks send, end to end: a real
`pagellm serve` on a tiny random model with the Hermes tool parser, through the `openai` SDK.

A random model follows no instructions, so every valid answer below is the constraint's doing:
`required` and named tool choices, JSON schemas, regexes and choices are enforced on token ids.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import BaseModel, Field

from server_utils import RemoteServer

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
               '</tool_call>')


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=9)
    sunny: bool


@pytest.fixture(scope="module")
def server(hermes_server: RemoteServer) -> RemoteServer:
    """The tiny llama with the Hermes parser and its template, shared with
    test_server_responses.py (shared_servers.py)."""
    return hermes_server


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


def chat(client: openai.OpenAI, **kwargs):
    kwargs.setdefault("max_tokens", 64)
    return client.chat.completions.create(model="tiny", messages=MESSAGES, **kwargs)


def streamed(client: openai.OpenAI, **kwargs):
    """The stream accumulated by the SDK's own helper, and the raw chunks."""
    state = ChatCompletionStreamState()
    chunks = list(chat(client, stream=True, **kwargs))
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.get_final_completion(), chunks


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(model="tiny", messages=MESSAGES,
                                               response_format=Forecast, max_tokens=80, seed=1,
                                               temperature=1.0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Forecast)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_returns_valid_calls(client: openai.OpenAI, stream: bool) -> None:
    kwargs = dict(tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120)
    if stream:
        completion, chunks = streamed(client, **kwargs)
        headers = [c for chunk in chunks for choice in chunk.choices
                   for c in choice.delta.tool_calls or [] if c.id]
        assert all(h.type == "function" and h.function.arguments == "" or h.function.arguments
                   for h in headers)
        assert [h.index for h in headers] == list(range(len(headers)))
    else:
        completion = chat(client, **kwargs)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and not choice.message.content
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in choice.message.tool_calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        assert "\n" not in call.function.arguments
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_streamed_tool_calls_equal_the_non_streamed(client: openai.OpenAI) -> None:
    for kwargs in (dict(tool_choice="required"),
                   dict(tool_choice={"type": "function", "function": {"name": "get_time"}}),
                   dict(tool_choice="auto", extra_body={"structured_outputs": {
                       "regex": re.escape(HERMES_CALL)}})):
        plain = chat(client, tools=TOOLS, temperature=0, max_tokens=120, **kwargs)
        stream, _ = streamed(client, tools=TOOLS, temperature=0, max_tokens=120, **kwargs)
        calls = [(c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls]
        assert calls == [(c.function.name, c.function.arguments)
                         for c in stream.choices[0].message.tool_calls]
        assert plain.choices[0].finish_reason == stream.choices[0].finish_reason


def test_named_tool_choice_finishes_with_stop(client: openai.OpenAI) -> None:
    response = chat(client, tools=TOOLS, temperature=0.8, seed=3,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_auto_parses_hermes_calls_and_none_parses_nothing(client: openai.OpenAI) -> None:
    forced = {"structured_outputs": {"regex": "Sure\\. " + re.escape(HERMES_CALL)}}
    choice = chat(client, tools=TOOLS, temperature=0, extra_body=forced,
                  max_tokens=200).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == [("get_weather", {"city": "Oslo", "days": 2})]
    choice = chat(client, tools=TOOLS, tool_choice="none", temperature=0, extra_body=forced,
                  max_tokens=200).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == "Sure. " + HERMES_CALL


def test_parallel_tool_calls_false_and_length(client: openai.OpenAI) -> None:
    two = HERMES_CALL + HERMES_CALL.replace("Oslo", "Lima")
    forced = {"structured_outputs": {"regex": re.escape(two)}}
    choice = chat(client, tools=TOOLS, temperature=0, max_tokens=300, extra_body=forced,
                  parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    kwargs = dict(tools=TOOLS, tool_choice="required", temperature=0, max_tokens=4)
    assert chat(client, **kwargs).choices[0].finish_reason == "length"
    chunks = list(chat(client, stream=True, **kwargs))
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [
        "length"]


def test_constraints_hold_over_many_seeded_samples(client: openai.OpenAI) -> None:
    specs = [({"json": WEATHER}, lambda text: jsonschema.validate(json.loads(text), WEATHER)),
             ({"regex": "[A-Z][a-z]{2,5}-[0-9]{3}"},
              lambda text: re.fullmatch("[A-Z][a-z]{2,5}-[0-9]{3}", text) or pytest.fail(text)),
             ({"choice": ["red", "green", "blue"]},
              lambda text: text in ("red", "green", "blue") or pytest.fail(text))]
    for spec, check in specs:
        for seed in range(3):
            response = chat(client, n=4, seed=seed, temperature=1.0, top_p=0.95,
                            presence_penalty=0.5, max_tokens=60,
                            extra_body={"structured_outputs": spec})
            for choice in response.choices:
                assert choice.finish_reason == "stop", choice
                check(choice.message.content)


def test_legacy_guided_fields_and_completions(client: openai.OpenAI) -> None:
    choice = chat(client, temperature=1.0, seed=5,
                  extra_body={"guided_choice": ["yes", "no"]}).choices[0]
    assert choice.message.content in ("yes", "no")
    text = chat(client, temperature=1.0, seed=5,
                extra_body={"guided_regex": "[0-9]{4}"}).choices[0].message.content
    assert re.fullmatch("[0-9]{4}", text)
    text = chat(client, temperature=1.0, seed=5, max_tokens=60,
                extra_body={"guided_json": json.dumps(WEATHER)}).choices[0].message.content
    jsonschema.validate(json.loads(text), WEATHER)
    completion = client.completions.create(model="tiny", prompt="Colour:", max_tokens=8,
                                           extra_body={"guided_choice": ["cyan", "teal"]})
    assert completion.choices[0].text in ("cyan", "teal")
    # any object: a random model's keys may run to max_tokens, so only the finished ones parse
    response = chat(client, max_tokens=40, response_format={"type": "json_object"}, n=6,
                    seed=2, temperature=1.0)
    for choice in response.choices:
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("body,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "strin"),
    ({"structured_outputs": {"regex": "a(b"}}, "regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "only one"),
    ({"structured_outputs": {"grammar": "root ::= (\"a\" | "}}, "grammar"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "nope"),
    ({"store": True}, "store"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"structured_outputs": {"json": {"type": "object"}}, "ignore_eos": True}, "ignore_eos"),
])
def test_what_cannot_be_honoured_is_a_400(server: RemoteServer, body: dict, needle: str) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]


def test_fields_clients_send_are_accepted(client: openai.OpenAI) -> None:
    response = chat(client, max_completion_tokens=3, user="u-1", metadata={"k": "v"},
                    store=False, service_tier="auto", parallel_tool_calls=True, temperature=0,
                    extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 3
    chunks = list(chat(client, max_tokens=3, stream=True, temperature=0,
                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 3


def test_langchain_bind_tools_and_structured_output(server: RemoteServer) -> None:
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", model="tiny",
                       temperature=0, max_tokens=120, max_retries=0)
    message = model.bind_tools(TOOLS, tool_choice="get_weather").invoke("Weather in Oslo?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER)
    forecast = model.with_structured_output(Forecast).invoke("Forecast for Paris?")
    assert isinstance(forecast, Forecast)


def test_litellm_completion_with_tools(server: RemoteServer) -> None:
    import litellm

    response = litellm.completion(model="openai/tiny", api_base=f"{server.url}/v1",
                                  api_key="EMPTY", messages=MESSAGES, tools=TOOLS,
                                  tool_choice="required", temperature=0, max_tokens=120)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    for call in choice.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time")
        json.loads(call.function.arguments)
