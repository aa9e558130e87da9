"""What a request constrains its output to, and the server's structured-output settings.

`StructuredOutputsParams` is vLLM's request-side record (`SamplingParams.structured_outputs`):
exactly one of `json`, `regex`, `choice`, `grammar`, `json_object` is set. Its `key` names
the compiled grammar it needs, so identical specs share one compilation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

BACKENDS = ("auto", "xgrammar", "guidance")
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
DEFAULT_MAX_WHITESPACE = 4
DEFAULT_COMPILE_TIMEOUT_S = 10.0


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None  # the library that compiles it; None: the engine's choice

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as error:
                raise ValueError(f"the JSON schema is not valid JSON: {error}.") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("the JSON schema must be a JSON object.")
        if self.json_object is False:
            self.json_object = None
        given = [name for name in _CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of "
                             f"{', '.join(_CONSTRAINTS)}; got {given or 'none'}.")
        if self.choice is not None and (not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported; use "
                             "disable_any_whitespace.")

    @property
    def kind(self) -> str:
        return next(name for name in _CONSTRAINTS if getattr(self, name) is not None)

    @property
    def key(self) -> tuple[str, str, bool]:
        """(kind, spec text, compact whitespace): what one compiled grammar is cached under."""
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return self.kind, text, self.disable_any_whitespace


@dataclass
class StructuredOutputsConfig:
    """`--structured-outputs-config` (vLLM's JSON keys, plus pagellm's whitespace bound and
    compile timeout). One backend serves every request of the engine."""

    backend: str = "auto"
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    max_whitespace: int = DEFAULT_MAX_WHITESPACE
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"structured outputs backend must be one of {', '.join(BACKENDS)}, "
                             f"got {self.backend!r}.")
        if self.disable_additional_properties and self.backend != "guidance":
            raise ValueError("disable_additional_properties is supported by the 'guidance' "
                             "backend only.")
        if self.max_whitespace < 0:
            raise ValueError(f"max_whitespace must be at least 0, got {self.max_whitespace}.")
        if self.compile_timeout_s <= 0:
            raise ValueError("compile_timeout_s must be positive.")

    @classmethod
    def parse(cls, text: str | None) -> "StructuredOutputsConfig":
        if not text:
            return cls()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"structured_outputs_config is not valid JSON: {error}.") from None
        if not isinstance(data, dict):
            raise ValueError("structured_outputs_config must be a JSON object.")
        known = {f.name for f in fields(cls)} | {"reasoning_parser", "enable_in_reasoning"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"structured_outputs_config has unknown keys {unknown}.")
        if data.pop("enable_in_reasoning", False) or data.pop("reasoning_parser", ""):
            raise ValueError("structured_outputs_config: reasoning_parser and "
                             "enable_in_reasoning are not supported.")
        return cls(**data)
