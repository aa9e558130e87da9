"""Several tokens a step, end to end: a server with n-gram speculation answers exactly as one
without, through the `openai` SDK, for streaming, stop strings, max_tokens, structured
outputs and tool calls. Both serve a tiny random llama as a quantized GGUF (batch
invariant), whose random text repeats itself enough for drafts to be accepted."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import httpx
import jsonschema
import openai
import pytest
from tiny_models import write_tiny_gguf

from server_utils import REPO_ROOT, RemoteServer, assert_clean_shutdown
from test_server_agents import TOOLS, WEATHER

TEMPLATE = REPO_ROOT / "examples" / "tool_chat_template_hermes.jinja"
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, ' \
       '"prompt_lookup_min": 1, "disable_adaptive": true}'
MESSAGES = [{"role": "user", "content": "Say it again and again: one two one two one two"}]


@pytest.fixture(scope="module")
def servers(tiny_model_factory: Callable[[str], Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RemoteServer]]:
    folder = tiny_model_factory("llama")
    path = write_tiny_gguf(folder, tmp_path_factory.mktemp("gguf") / "tiny.gguf",
                           gguf.GGMLQuantizationType.Q4_1,
                           embedding_quantization=gguf.GGMLQuantizationType.Q8_0)
    common = ("--tokenizer", str(folder), "--served-model-name", "tiny",
              "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
              "--chat-template", str(TEMPLATE))
    # started together: each start is mostly imports and a load, one core's work
    remotes = {"plain": RemoteServer(path, *common, wait=False),
               "spec": RemoteServer(path, *common, "--speculative-config", SPEC, wait=False)}
    for remote in remotes.values():
        remote.wait_healthy()
    yield remotes
    for remote in remotes.values():
        assert_clean_shutdown(remote.stop())


def both(servers: dict[str, RemoteServer], call: Callable[[openai.OpenAI], object]) -> list:
    return [call(servers[name].client()) for name in ("plain", "spec")]


def chat(client: openai.OpenAI, **kwargs):
    kwargs.setdefault("max_tokens", 60)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=MESSAGES, **kwargs)


def streamed_text(client: openai.OpenAI, **kwargs) -> tuple[str, str | None, int]:
    text, reason, chunks = "", None, 0
    for chunk in chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
            chunks += 1
    return text, reason, chunks


def test_text_streaming_stops_and_lengths_are_as_without(
        servers: dict[str, RemoteServer]) -> None:
    for kwargs in (dict(), dict(max_tokens=5), dict(max_tokens=1), dict(stop=["two", "e"]),
                   dict(temperature=0.8, seed=11)):
        plain, spec = both(servers, lambda c: chat(c, **kwargs))
        assert spec.choices[0].message.content == plain.choices[0].message.content, kwargs
        assert spec.choices[0].finish_reason == plain.choices[0].finish_reason
        assert spec.usage.completion_tokens == plain.usage.completion_tokens
        assert spec.usage.completion_tokens <= kwargs.get("max_tokens", 60)
        text, reason, _ = streamed_text(servers["spec"].client(), **kwargs)
        assert (text, reason) == (plain.choices[0].message.content,
                                  plain.choices[0].finish_reason)
    completions = both(servers, lambda c: c.completions.create(
        model="tiny", prompt="one two three one two three one", max_tokens=30, temperature=0,
        logprobs=2))
    assert completions[1].choices[0].text == completions[0].choices[0].text
    assert completions[1].choices[0].logprobs.top_logprobs == \
        completions[0].choices[0].logprobs.top_logprobs


def test_structured_outputs_and_tool_calls_are_as_without(
        servers: dict[str, RemoteServer]) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {
        "type": "array", "items": {"type": "integer"}}}, "required": ["a", "b"]}
    plain, spec = both(servers, lambda c: chat(c, max_tokens=80, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert spec.choices[0].message.content == plain.choices[0].message.content
    if spec.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(spec.choices[0].message.content), schema)
    for stream in (False, True):
        kwargs = dict(tools=TOOLS, tool_choice="required", max_tokens=120, stream=stream)
        plain, spec = both(servers, lambda c: _tool_calls(c, **kwargs))
        assert spec == plain
        for name, arguments in spec[0]:
            if name == "get_weather":
                jsonschema.validate(json.loads(arguments), WEATHER)


def _tool_calls(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[list, str]:
    if not stream:
        choice = chat(client, **kwargs).choices[0]
        return ([(c.function.name, c.function.arguments) for c in choice.message.tool_calls],
                choice.finish_reason)
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    for chunk in chat(client, stream=True, **kwargs):
        state.handle_chunk(chunk)
    choice = state.get_final_completion().choices[0]
    return ([(c.function.name, c.function.arguments) for c in choice.message.tool_calls],
            choice.finish_reason)


def test_the_speculating_server_counts_drafts(servers: dict[str, RemoteServer]) -> None:
    both(servers, lambda c: chat(c, max_tokens=40))
    text = httpx.get(f"{servers['spec'].url}/metrics").text
    drafts = [line for line in text.splitlines()
              if line.startswith("vllm:spec_decode_num_drafts_total")]
    assert drafts and float(drafts[0].split()[-1]) > 0
    assert ('vllm:spec_decode_num_accepted_tokens_per_pos_total'
            '{engine="0",model_name="tiny",position="3"}') \
        in text
    assert "vllm:spec_decode" not in httpx.get(f"{servers['plain'].url}/metrics").text
