"""Pythonic tool calls (Llama 3.2/4, ToolACE): `[get_weather(city="Paris"), now()]`.

Keyword values are Python literals, so the arguments are known only once a call's closing
parenthesis is in: each call is settled whole and its arguments are `json.dumps` of the
keywords. A call that does not parse as literals is left out, streamed or not.
"""

from __future__ import annotations

import ast
import json

from pagellm.entrypoints.openai.tool_parsers.core import ParsedCall, ParseResult, ToolParser

_WHITESPACE = " \t\r\n"
_TAGS = ("<|python_start|>", "<|python_tag|>")


def _call_ends(text: str, start: int) -> list[int]:
    """Indices just past each complete top-level call of the list opening at text[start]."""
    ends, depth, quote, escape = [], 0, "", False
    for i in range(start, len(text)):
        char = text[i]
        if quote:
            if escape:
                escape = False
            elif char == "\\":
                escape = True
            elif char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 1 and char == ")":
                ends.append(i + 1)
            if depth == 0:
                break
    return ends


def _parse_call(source: str) -> ParsedCall | None:
    try:
        node = ast.parse(source.strip(" \t\r\n,"), mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    except (SyntaxError, ValueError, TypeError):
        return None
    if None in arguments:  # **kwargs
        return None
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


class PythonicToolParser(ToolParser):
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> ParseResult:
        body = text.lstrip(_WHITESPACE)
        for tag in _TAGS:
            if body.startswith(tag):
                body = body[len(tag):].lstrip(_WHITESPACE)
            elif not final and body and tag.startswith(body):
                return ParseResult("")
        if not body.startswith("["):
            return ParseResult("" if not body and not final else text)
        start = len(text) - len(body)
        calls, previous = [], start + 1
        for end in _call_ends(text, start):
            call = _parse_call(text[previous:end])
            if call is not None:
                calls.append(call)
            previous = end
        return ParseResult("", calls)
