"""`/v1/responses` end to end: a real `pagellm serve` on a tiny random model with the Hermes
tool parser, through the `openai` SDK's own Responses client and stream accumulator.

The Responses API is a second shape of the chat conversation, so its greedy answers are
compared with chat completions' on the same conversation: any translation slip (a lost
instruction, a history turn in the wrong place) changes the tokens.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from pagellm.entrypoints.openai.chat_output import ChoiceDelta
from pagellm.entrypoints.openai.response_models import DeltaFunctionCall, DeltaToolCall
from pagellm.entrypoints.openai.responses.events import ResponseBuilder
from pagellm.entrypoints.openai.responses.objects import (InputTokensDetails,
                                                          OutputTokensDetails, ResponseObject,
                                                          ResponseUsage)
from pagellm.entrypoints.openai.responses.store import ResponseStore, StoredResponse
from server_utils import RemoteServer
from test_server_agents import WEATHER, client, server  # noqa: F401 (fixtures: one tiny Hermes server)

TOOLS = [{"type": "function", "name": "get_weather", "description": "Forecast",
          "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                                "parameters": WEATHER}}]


class Answer(BaseModel):
    city: Literal["Paris", "Oslo"]
    sunny: bool


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    completion = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                                max_tokens=max_tokens)
    return completion.choices[0].message.content, completion.usage.prompt_tokens


def test_text_answer_equals_chat_completions(client: openai.OpenAI) -> None:
    response = client.responses.create(model="tiny", instructions="Be brief.",
                                       input="Name a colour.", temperature=0,
                                       max_output_tokens=12)
    text, prompt_tokens = chat_text(client, [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Name a colour."}], 12)
    assert response.output_text == text
    assert response.usage.input_tokens == prompt_tokens
    assert response.usage.output_tokens == 12 and response.usage.total_tokens == prompt_tokens + 12
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.status == "incomplete"
    assert response.id.startswith("resp_") and message.id.startswith("msg_")


def test_stream_events_build_the_non_streamed_response(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", input=[{"role": "user", "content": "Count to three."}],
                  temperature=0, max_output_tokens=10, top_logprobs=2)
    plain = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    final = events[-1].response  # the SDK's get_final_response() wants response.completed
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert "".join(event.delta for event in deltas) == final.output_text == plain.output_text
    logprobs = plain.output[0].content[0].logprobs
    assert len(logprobs) == 10 and all(len(entry.top_logprobs) == 2 for entry in logprobs)
    assert [entry.token for entry in logprobs] == [
        entry.token for event in deltas for entry in event.logprobs]


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    response = client.responses.parse(model="tiny", input="Weather?", text_format=Answer,
                                      temperature=1.0, max_output_tokens=60)
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Answer)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_call_then_its_output_continue_the_conversation(
        client: openai.OpenAI, stream: bool) -> None:
    kwargs = dict(model="tiny", input="Weather in Oslo?", tools=TOOLS, tool_choice="required",
                  temperature=0, max_output_tokens=120)
    if stream:
        with client.responses.stream(**kwargs) as events:
            argument_deltas = "".join(event.delta for event in events
                                      if event.type == "response.function_call_arguments.delta")
            first = events.get_final_response()
    else:
        first = client.responses.create(**kwargs)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed"
    arguments = json.loads(calls[0].arguments)
    jsonschema.validate(arguments, WEATHER)
    if stream:
        assert argument_deltas == "".join(call.arguments for call in calls)
    follow_up = client.responses.create(
        model="tiny", previous_response_id=first.id, temperature=0, max_output_tokens=6,
        tools=TOOLS, tool_choice="none",  # tools are not inherited, as with OpenAI
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
               for call in calls])
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.call_id, "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}
                   for call in calls]}]
    history += [{"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}
                for call in calls]
    completion = client.chat.completions.create(model="tiny", messages=history, tools=CHAT_TOOLS,
                                                tool_choice="none", temperature=0, max_tokens=6)
    assert follow_up.usage.input_tokens == completion.usage.prompt_tokens
    assert follow_up.output_text == completion.choices[0].message.content
    assert follow_up.previous_response_id == first.id


def test_store_retrieve_delete(client: openai.OpenAI) -> None:
    stored = client.responses.create(model="tiny", input="Hi", max_output_tokens=3,
                                     metadata={"team": "sre"})
    fetched = client.responses.retrieve(stored.id)
    assert fetched.model_dump() == stored.model_dump() and fetched.metadata == {"team": "sre"}
    client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)
    unstored = client.responses.create(model="tiny", input="Hi", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError, match="Previous response with id"):
        client.responses.create(model="tiny", input="Hi", previous_response_id=unstored.id)


@pytest.mark.parametrize("body, words", [
    ({"tools": [{"type": "web_search"}]}, "tool type 'web_search'"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "item type 'input_image'"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include values"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0]"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
])
def test_what_cannot_be_honoured_is_a_400(server: RemoteServer, body: dict, words: str) -> None:
    answer = httpx.post(f"{server.url}/v1/responses", timeout=30,
                        json={"model": "tiny", "input": "Hi", **body})
    assert answer.status_code == 400, answer.text
    assert words in answer.json()["error"]["message"]


def test_builder_orders_reasoning_text_and_calls_as_openai_does() -> None:
    builder = ResponseBuilder(ResponseObject(id="resp_1", model="tiny"))
    deltas = [ChoiceDelta(reasoning="Think"), ChoiceDelta(reasoning="ing."),
              ChoiceDelta(content="Let me check."),
              ChoiceDelta(tool_calls=[DeltaToolCall(index=0, id="call_a", type="function",
                                                    function=DeltaFunctionCall(name="f"))]),
              ChoiceDelta(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(
                  arguments='{"x": 1}'))])]
    events = builder.start()
    for delta in deltas:
        events += builder.feed(delta, [])
    usage = ResponseUsage(input_tokens=3, input_tokens_details=InputTokensDetails(),
                          output_tokens=5, output_tokens_details=OutputTokensDetails(),
                          total_tokens=8)
    events += builder.finish("tool_calls", usage)
    adapter = TypeAdapter(ResponseStreamEvent)
    typed = [adapter.validate_python(event) for event in events]
    assert [event.type for event in typed] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    final = typed[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "Thinking."
    assert final.output_text == "Let me check."
    assert (final.output[2].call_id, final.output[2].arguments) == ("call_a", '{"x": 1}')
    assert all(item.status == "completed" for item in final.output)


def test_store_keeps_the_most_recently_used() -> None:
    store = ResponseStore(max_entries=2)
    entries = [StoredResponse(ResponseObject(id=f"resp_{i}", model="m"), []) for i in range(3)]
    store.put(entries[0])
    store.put(entries[1])
    assert store.get("resp_0") is entries[0]  # now the most recent
    store.put(entries[2])
    assert [store.get(f"resp_{i}") for i in range(3)] == [entries[0], None, entries[2]]
    assert store.delete("resp_0") and not store.delete("resp_0")
    ResponseStore(max_entries=0).put(entries[0])  # keeps nothing, raises nothing
