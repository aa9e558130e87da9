"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.input_processor import PromptType
from pagellm.engine.llm_engine import LLMEngine
from pagellm.lora.request import LoRARequest
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """Generate from a list of prompts with continuous batching.

    `model=None` serves the embedded SmolLM2-135M-Instruct GGUF.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None) per prompt."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = self._per_prompt(SamplingParams() if sampling_params is None else sampling_params,
                                  len(prompts), "sampling params")
        loras = self._per_prompt(lora_request, len(prompts), "LoRA requests")
        request_ids = []
        for prompt, prompt_params, lora in zip(prompts, params, loras):
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, prompt, prompt_params, lora_request=lora)
            request_ids.append(request_id)
        return self._run_engine(request_ids, use_tqdm)

    def chat(self, messages: ChatMessages | Sequence[ChatMessages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.engine.apply_chat_template(
            conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt)}
            for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    @staticmethod
    def _per_prompt(value: Any, count: int, what: str) -> list[Any]:
        if value is None or not isinstance(value, Sequence):
            return [value] * count
        if len(value) != count:
            raise ValueError(f"got {len(value)} {what} for {count} prompts.")
        return list(value)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True,
                   disable=not use_tqdm)
        input_tokens = output_tokens = 0
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if not output.finished:
                    continue
                finished[output.request_id] = output
                input_tokens += len(output.prompt_token_ids)
                output_tokens += sum(len(c.token_ids) for c in output.outputs)
                elapsed = bar.format_dict["elapsed"] or 1e-9
                bar.set_postfix_str(f"est. speed input: {input_tokens / elapsed:.2f} toks/s, "
                                    f"output: {output_tokens / elapsed:.2f} toks/s", refresh=False)
                bar.update(1)
        bar.close()
        return [finished[request_id] for request_id in request_ids]
