"""The incremental core every tool-call format shares.

A parser is a pure function of the text generated so far: `parse(text, final)` returns the
content and the calls that are *settled* in that text, each call's arguments only as far as
they can no longer change. Parsing the whole text again at every delta (the texts are short)
makes the result independent of how the text was split into deltas; the streamer sends only
what grew since the last delta. So the concatenation of what is streamed equals the
non-streamed answer for any chunking (one token at a time, or many, as speculative decoding
delivers them), which `tests/test_tool_parsers.py` checks at every split point.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text; while streaming, a prefix of the final arguments


@dataclass
class ParseResult:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser(ABC):
    """vLLM's `--tool-call-parser` interface, reduced to the one function that matters."""

    #: special tokens carry this format's markers: keep them in the text
    keeps_special_tokens: bool = False

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParseResult:
        """What `text` settles. With final=False, a trailing part that may still turn into a
        marker is held back from the content."""


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallStreamer:
    """Feeds text deltas to a parser and returns what is new for the client."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.ids: list[str] = []
        self._sent_content = 0
        self._sent_arguments: list[int] = []

    def feed(self, delta: str, final: bool = False) -> StreamDelta:
        self.text += delta
        result = limit_calls(self.parser.parse(self.text, final), self.max_calls)
        out = StreamDelta(content=result.content[self._sent_content:])
        self._sent_content = len(result.content)
        for index, call in enumerate(result.calls):
            if index == len(self.ids):
                self.ids.append(make_tool_call_id())
                self._sent_arguments.append(0)
                out.tool_calls.append(ToolCallDelta(index, self.ids[index], call.name))
            fragment = call.arguments[self._sent_arguments[index]:]
            self._sent_arguments[index] = len(call.arguments)
            if fragment:
                if out.tool_calls and out.tool_calls[-1].index == index:
                    out.tool_calls[-1].arguments += fragment
                else:
                    out.tool_calls.append(ToolCallDelta(index, arguments=fragment))
        return out


def limit_calls(result: ParseResult, max_calls: int | None) -> ParseResult:
    """`parallel_tool_calls: false`: at most the first call."""
    if max_calls is None or len(result.calls) <= max_calls:
        return result
    return ParseResult(result.content, result.calls[:max_calls])
