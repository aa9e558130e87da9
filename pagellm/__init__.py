"""pagellm: an LLM serving engine with a paged KV cache and continuous batching."""

from pagellm.entrypoints.llm import LLM
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
