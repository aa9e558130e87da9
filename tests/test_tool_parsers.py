"""Tool-call parsers: every output replayed split at every chunk boundary (one character at a
time, and in steps of several, as speculative decoding delivers them) streams to exactly the
non-streamed result."""

from __future__ import annotations

import json

import pytest

from pagellm.entrypoints.openai.tool_parsers import ToolParserManager, parser_for_template
from pagellm.entrypoints.openai.tool_parsers.core import ToolCallStreamer, ToolParser
from pagellm.entrypoints.openai.tool_parsers.json_calls import NamedToolParser, RequiredToolParser

HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"cmd": "mkdir -p a/{b,c} \\"}\\""}}\n</tool_call>\n<tool_call>\n{"arguments": {}, '
          '"name": "now"}\n</tool_call>')
CASES = [
    ("hermes", HERMES, "Let me check.",
     [("get_weather", {"city": "Paris", "cmd": 'mkdir -p a/{b,c} "}"'}), ("now", {})]),
    ("hermes", "No tools needed <tool here.", "No tools needed <tool here.", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": [1, {"y": 2}]', "",
     [("f", None)]),  # cut off by max_tokens: the partial arguments, as streamed
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                '{"name": "ping", "arguments": {}}]', "", [("add", {"a": 1, "b": 2}),
                                                           ("ping", {})]),
    # mistral-common's v11+ format: a name, [ARGS], its arguments, once a call
    ("mistral", 'Je regarde.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "q": "a}b"}'
                '[TOOL_CALLS]ping[ARGS]{}', "Je regarde.",
     [("get_weather", {"city": "Paris", "q": "a}b"}), ("ping", {})]),
    ("llama3_json", '{"name": "search", "parameters": {"q": "cats"}}; '
                    '{"name": "noop", "parameters": {}}', "",
     [("search", {"q": "cats"}), ("noop", {})]),
    ("llama3_json", '<|python_tag|>{"name": "search", "parameters": {"q": "a,b"}}', "",
     [("search", {"q": "a,b"})]),
    ("llama3_json", "Hello {there}", "Hello {there}", []),
    ("pythonic", '[get_weather(city="San Francisco", units=\'c\'), now(), bad(*x)]', "",
     [("get_weather", {"city": "San Francisco", "units": "c"}), ("now", {})]),
    ("pythonic", "Plain answer.", "Plain answer.", []),
]


def make_parser(name: str) -> ToolParser:
    return ToolParserManager.get(name)()


def replay(parser: ToolParser, text: str, size: int, max_calls: int | None = None
           ) -> tuple[str, list[tuple[str, str]]]:
    """Stream `text` in chunks of `size` characters; what the client accumulates."""
    streamer = ToolCallStreamer(parser, max_calls)
    content, calls = "", []
    chunks = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for number, chunk in enumerate(chunks):
        delta = streamer.feed(chunk, final=number == len(chunks) - 1)
        content += delta.content
        for call in delta.tool_calls:
            if call.id is not None:
                assert call.index == len(calls) and call.name
                calls.append([call.name, ""])
            calls[call.index][1] += call.arguments
    return content, [tuple(c) for c in calls]


@pytest.mark.parametrize("name,text,content,expected", CASES)
def test_stream_equals_non_stream_at_every_chunking(name: str, text: str, content: str,
                                                    expected: list) -> None:
    final = make_parser(name).parse(text, final=True)
    assert final.content == content
    assert [c.name for c in final.calls] == [e[0] for e in expected]
    for call, (_, arguments) in zip(final.calls, expected):
        if arguments is not None:
            assert json.loads(call.arguments) == arguments
    want = (final.content, [(c.name, c.arguments) for c in final.calls])
    for size in range(1, len(text) + 1):
        assert replay(make_parser(name), text, size) == want, size


def test_every_split_point_of_two_chunks() -> None:
    want = replay(make_parser("hermes"), HERMES, len(HERMES))
    for cut in range(len(HERMES) + 1):
        streamer = ToolCallStreamer(make_parser("hermes"))
        first, second = streamer.feed(HERMES[:cut]), streamer.feed(HERMES[cut:], final=True)
        content = first.content + second.content
        assert content == want[0]
        arguments: dict[int, str] = {}
        for call in first.tool_calls + second.tool_calls:
            arguments[call.index] = arguments.get(call.index, "") + call.arguments
        assert [arguments[i] for i in sorted(arguments)] == [a for _, a in want[1]]


def test_required_and_named_outputs() -> None:
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    final = RequiredToolParser().parse(text, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in final.calls] == [("a", {"x": 1}),
                                                                         ("b", {})]
    for size in (1, 3, 7):
        assert replay(RequiredToolParser(), text, size)[1] == [
            (c.name, c.arguments) for c in final.calls]
    named = ' {"city": "Oslo"} '
    assert replay(NamedToolParser("w"), named, 2) == ("", [("w", '{"city": "Oslo"}')])


def test_parallel_tool_calls_false_keeps_the_first() -> None:
    assert replay(make_parser("hermes"), HERMES, 5, max_calls=1)[1] == [
        ("get_weather", make_parser("hermes").parse(HERMES, True).calls[0].arguments)]


def test_parser_from_template_and_plugin(tmp_path) -> None:
    assert parser_for_template("{{ '<tool_call>' }}") == "hermes"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("plain") is None
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from pagellm.entrypoints.openai.tool_parsers import ToolParserManager\n"
        "from pagellm.entrypoints.openai.tool_parsers.core import ParsedCall, ParseResult, "
        "ToolParser\n"
        "@ToolParserManager.register_module('shout')\n"
        "class Shout(ToolParser):\n"
        "    def parse(self, text, final):\n"
        "        return ParseResult('', [ParsedCall(text.strip(), '{}')] if final else [])\n")
    ToolParserManager.load_plugin(str(plugin))
    assert ToolParserManager.get("shout")().parse("go", True).calls[0].name == "go"
    with pytest.raises(ValueError, match="unknown tool call parser"):
        ToolParserManager.get("nope")
