"""pagellm: an LLM serving engine with a paged KV cache and continuous batching."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagellm.entrypoints.llm import LLM
    from pagellm.outputs import CompletionOutput, RequestOutput
    from pagellm.sampling_params import SamplingParams

__version__ = "0.1.0"

# Resolved on first use, so that `pagellm bench serve` and `--help` (which import only
# submodules) do not load torch and the engine: about 3 s.
_EXPORTS = {"LLM": "pagellm.entrypoints.llm", "SamplingParams": "pagellm.sampling_params",
            "RequestOutput": "pagellm.outputs", "CompletionOutput": "pagellm.outputs"}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagellm' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
