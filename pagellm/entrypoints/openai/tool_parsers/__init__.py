"""Tool-call parsers by vLLM's `--tool-call-parser` names, and `--tool-parser-plugin`.

A plugin is a Python file that registers its parser class:

    from pagellm.entrypoints.openai.tool_parsers import ToolParserManager
    from pagellm.entrypoints.openai.tool_parsers.core import ParseResult, ToolParser

    @ToolParserManager.register_module("my_format")
    class MyParser(ToolParser):
        def parse(self, text, final): ...
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from pagellm.entrypoints.openai.tool_parsers.core import ToolParser
from pagellm.entrypoints.openai.tool_parsers.json_calls import (HermesToolParser,
                                                                Llama3JsonToolParser,
                                                                MistralToolParser)
from pagellm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

# a marker in the chat template -> the parser for its format, for `--tool-call-parser` unset
_TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                     ("<|python_tag|>", "llama3_json"), ("<|python_start|>", "pythonic"))


class ToolParserManager:
    parsers: dict[str, type[ToolParser]] = {
        "hermes": HermesToolParser, "mistral": MistralToolParser,
        "llama3_json": Llama3JsonToolParser, "pythonic": PythonicToolParser,
        "llama4_pythonic": PythonicToolParser,
    }

    @classmethod
    def register_module(cls, name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
        def register(parser: type[ToolParser]) -> type[ToolParser]:
            cls.parsers[name] = parser
            return parser
        return register

    @classmethod
    def get(cls, name: str) -> type[ToolParser]:
        if name not in cls.parsers:
            raise ValueError(f"unknown tool call parser {name!r}; choose one of "
                             f"{', '.join(sorted(cls.parsers))} or register one with "
                             "--tool-parser-plugin.")
        return cls.parsers[name]

    @staticmethod
    def load_plugin(path: str) -> None:
        file = Path(path).expanduser()
        if not file.is_file():
            raise ValueError(f"tool parser plugin {path!r} is not a file.")
        spec = importlib.util.spec_from_file_location(f"pagellm_tool_plugin_{file.stem}", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def parser_for_template(template: str | None) -> str | None:
    """The parser whose marker the chat template writes, if any."""
    for marker, name in _TEMPLATE_MARKERS:
        if template and marker in template:
            return name
    return None
