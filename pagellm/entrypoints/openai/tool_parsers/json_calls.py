"""Tool calls written as JSON objects `{"name": ..., "arguments": {...}}` after a marker:
Hermes/Qwen (`<tool_call>`), Mistral (`[TOOL_CALLS]`), Llama 3 JSON, and the JSON array that
`tool_choice: required` constrains the output to.

Arguments are the model's own text of the value (it is JSON already), cut by string-aware
brace matching; so a streamed fragment is never re-serialized, and braces inside strings
(`"mkdir -p a/{b,c}"`) do not end it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pagellm.entrypoints.openai.tool_parsers.core import ParsedCall, ParseResult, ToolParser

_WHITESPACE = " \t\r\n"


@dataclass
class ObjectScan:
    """Depth-1 keys of a JSON object: key -> (value start, value end or None if still open)."""

    values: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None  # index just past the closing brace


def scan_object(text: str, start: int) -> ObjectScan:  # noqa: C901 - one character loop
    """Scan the object opening at text[start] == "{" as far as text goes."""
    scan = ObjectScan()
    depth, in_string, escape = 0, False, False
    key_start: int | None = None
    last_key: str | None = None
    open_key: str | None = None  # the key whose value is being read
    for i in range(start, len(text)):
        char = text[i]
        if in_string:
            if escape:
                escape = False
            elif char == "\\":
                escape = True
            elif char == '"':
                in_string = False
                if depth == 1 and key_start is not None and open_key is None:
                    last_key = _loads(text[key_start:i + 1])
                    key_start = None
            continue
        if char == '"':
            in_string = True
            if depth == 1 and open_key is None:
                key_start = i
        elif char == ":" and depth == 1 and last_key is not None:
            open_key, last_key = last_key, None
            scan.values[open_key] = (_skip_whitespace(text, i + 1), None)
        elif char in "{[":
            depth += 1
        elif char in "}]" or (char == "," and depth == 1):
            if depth == 1 and open_key is not None:
                scan.values[open_key] = (scan.values[open_key][0], i)
                open_key = None
            if char != ",":
                depth -= 1
                if depth == 0:
                    scan.end = i + 1
                    return scan
    return scan


def _skip_whitespace(text: str, index: int) -> int:
    while index < len(text) and text[index] in _WHITESPACE:
        index += 1
    return index


def _loads(text: str) -> str | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def value_text(text: str, span: tuple[int, int | None]) -> str:
    start, end = span
    return text[start:end].rstrip(_WHITESPACE)


def calls_from(text: str, start: int, argument_keys: tuple[str, ...],
               final: bool) -> list[ParsedCall]:
    """Every object from `start` on that names a function, as far as it is settled."""
    calls = []
    index = text.find("{", start)
    while index >= 0:
        scan = scan_object(text, index)
        name_span = scan.values.get("name")
        name = (_loads(value_text(text, name_span))
                if name_span is not None and name_span[1] is not None else None)
        if name is None and scan.end is None and not final:
            break
        if name is not None:
            calls.append(ParsedCall(name, _arguments(text, scan, argument_keys, final)))
        if scan.end is None:
            break
        index = text.find("{", scan.end)
    return calls


def _arguments(text: str, scan: ObjectScan, keys: tuple[str, ...], final: bool) -> str:
    span = next((scan.values[key] for key in keys if key in scan.values), None)
    if span is None:
        return "{}" if scan.end is not None or final else ""
    return value_text(text, span)


def split_at_marker(text: str, marker: str, final: bool) -> tuple[str, int | None]:
    """(content, index where the calls begin or None). While streaming, a tail of the text
    that could be the start of the marker is held back from the content."""
    found = text.find(marker)
    if found >= 0:
        return text[:found], found + len(marker)
    if not final:
        for keep in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-keep:]):
                return text[:-keep], None
    return text, None


class MarkerJsonToolParser(ToolParser):
    """Content until the first marker, then JSON call objects."""

    marker: str = ""
    argument_keys: tuple[str, ...] = ("arguments", "parameters")

    def parse(self, text: str, final: bool) -> ParseResult:
        content, start = split_at_marker(text, self.marker, final)
        if start is None:
            return ParseResult(content)
        return ParseResult(content, calls_from(text, start, self.argument_keys, final))


class HermesToolParser(MarkerJsonToolParser):
    """`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` (Hermes, Qwen2.5/3)."""

    marker = "<tool_call>"
    keeps_special_tokens = True


class MistralToolParser(MarkerJsonToolParser):
    """`[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]` (mistral-common's tokenizers
    up to v7), or `[TOOL_CALLS]f[ARGS]{...}` once a call (v11 and later, as Ministral 3's)."""

    marker = "[TOOL_CALLS]"
    keeps_special_tokens = True
    _ARGS = "[ARGS]"

    def parse(self, text: str, final: bool) -> ParseResult:
        content, start = split_at_marker(text, self.marker, final)
        if start is None or text[start:].lstrip(_WHITESPACE)[:1] in ("[", "{"):
            return super().parse(text, final)
        calls = []
        for segment in text[start:].split(self.marker):
            name, found, rest = segment.partition(self._ARGS)
            if not found:
                break  # the name is still being written
            calls.append(ParsedCall(name.strip(_WHITESPACE), _object_text(rest, final)))
        return ParseResult(content, calls)


def _object_text(text: str, final: bool) -> str:
    """The JSON object that `text` opens, as far as it goes."""
    begin = _skip_whitespace(text, 0)
    if begin >= len(text) or text[begin] != "{":
        return "{}" if final else ""
    end = scan_object(text, begin).end
    return text[begin:end].rstrip(_WHITESPACE)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: the answer *is* `{"name": ..., "parameters": {...}}` (calls may
    be separated by `;`), optionally after `<|python_tag|>`; any other start is content."""

    keeps_special_tokens = True
    _TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ParseResult:
        body = text.lstrip(_WHITESPACE)
        if body.startswith(self._TAG):
            body = body[len(self._TAG):].lstrip(_WHITESPACE)
        elif not final and self._TAG.startswith(body):
            return ParseResult("")
        if not body.startswith("{"):
            return ParseResult("" if not body and not final else text)
        start = len(text) - len(body)
        return ParseResult("", calls_from(text, start, ("parameters", "arguments"), final))


class RequiredToolParser(ToolParser):
    """What `tool_choice: required` constrains the output to: `[{"name", "parameters"}, ...]`."""

    def parse(self, text: str, final: bool) -> ParseResult:
        return ParseResult("", calls_from(text, 0, ("parameters",), final))


class NamedToolParser(ToolParser):
    """A named `tool_choice`: the whole output is the function's arguments."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool) -> ParseResult:
        return ParseResult("", [ParsedCall(self.name, text.strip(_WHITESPACE))])
