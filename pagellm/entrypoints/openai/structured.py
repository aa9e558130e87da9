"""A request's output constraint, from whichever field the client used: OpenAI's
`response_format`, vLLM's `structured_outputs`, or the legacy `guided_*` fields (which vLLM
0.12 silently ignores; here they constrain as they used to). Two sources at once, or a spec
the grammar library rejects, is a 400 that names the problem: never an unconstrained answer.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pagellm.entrypoints.openai.errors import OpenAIError
from pagellm.entrypoints.openai.protocol import (ChatCompletionTool, NamedToolChoice,
                                                 SamplingRequest)
from pagellm.structured_outputs.backend import choose_backend
from pagellm.structured_outputs.params import StructuredOutputsConfig, StructuredOutputsParams

_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_BACKEND_NAMES = {"xgrammar": "xgrammar", "guidance": "guidance", "llguidance": "guidance"}


def _from_response_format(request: SamplingRequest) -> dict[str, Any] | None:
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"json_object": True}
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise OpenAIError("response_format json_schema needs json_schema.schema.",
                          param="response_format")
    return {"json": spec.schema_}


def _from_legacy(request: SamplingRequest) -> dict[str, Any] | None:
    fields = {target: getattr(request, name) for name, target in _LEGACY.items()
              if getattr(request, name) is not None}
    if not fields:
        return None
    if request.guided_whitespace_pattern is not None:
        fields["whitespace_pattern"] = request.guided_whitespace_pattern
    return fields


def requested_constraint(request: SamplingRequest) -> dict[str, Any] | None:
    """The constraint fields of the request, from at most one source."""
    sources = {"response_format": _from_response_format(request),
               "structured_outputs": request.structured_outputs, "guided_*": _from_legacy(request)}
    given = {name: spec for name, spec in sources.items() if spec}
    if len(given) > 1:
        raise OpenAIError(f"set only one of {' and '.join(given)}: each constrains the output.",
                          param=next(iter(given)))
    spec = next(iter(given.values()), None)
    if spec is not None and "choices" in spec:  # vLLM's docs spell it so
        spec = {("choice" if key == "choices" else key): value for key, value in spec.items()}
    return spec


def tool_choice_constraint(tools: list[ChatCompletionTool],
                           tool_choice: str | NamedToolChoice) -> dict[str, Any] | None:
    """`required`: a JSON array of at least one {name, parameters} call of the given tools
    (vLLM's schema); a named function: that function's parameters. Both in the one-line
    layout of `json.dumps`, whose spaces models expect: no runs of newlines in arguments."""
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        tool = next((t for t in tools if t.function.name == name), None)
        if tool is None:
            raise OpenAIError(f"tool_choice names {name!r}, which is not in tools.",
                              param="tool_choice")
        return {"json": tool.function.parameters or {"type": "object"},
                "disable_any_whitespace": True}
    if tool_choice != "required":
        return None
    definitions: dict[str, Any] = {}
    variants = []
    for tool in tools:
        parameters = dict(tool.function.parameters or {"type": "object"})
        definitions.update(parameters.pop("$defs", {}))
        variants.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                        "parameters": parameters},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": variants}}
    if definitions:
        schema["$defs"] = definitions
    return {"json": schema, "disable_any_whitespace": True}


def _params(spec: dict[str, Any], backend: str | None) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**spec, backend=backend)
    except TypeError as error:
        raise OpenAIError(f"structured_outputs: {error}.", param="structured_outputs") from None
    except ValueError as error:
        raise OpenAIError(str(error), param="structured_outputs") from None


async def resolve_constraint(spec: dict[str, Any] | None, backend_request: str | None,
                             config: StructuredOutputsConfig) -> StructuredOutputsParams | None:
    """Validate off the event loop, within the compile timeout; the spec with its backend."""
    if spec is None:
        return None
    if backend_request is not None and backend_request not in _BACKEND_NAMES:
        raise OpenAIError(f"guided_decoding_backend {backend_request!r} is not one of "
                          f"{', '.join(_BACKEND_NAMES)}.", param="guided_decoding_backend")
    params = _params(spec, None)
    if backend_request is not None:
        config = StructuredOutputsConfig(**{**config.__dict__,
                                            "backend": _BACKEND_NAMES[backend_request]})
    try:
        params.backend = await asyncio.wait_for(asyncio.to_thread(choose_backend, params, config),
                                                config.compile_timeout_s)
    except TimeoutError:
        raise OpenAIError(f"the {params.kind} constraint did not compile within "
                          f"{config.compile_timeout_s} s.", param="structured_outputs") from None
    except ValueError as error:
        raise OpenAIError(str(error), param="structured_outputs") from None
    return params
