"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.input_processor import PromptType
from pagellm.engine.llm_engine import LLMEngine
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
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = self._params_per_prompt(sampling_params, len(prompts))
        request_ids = []
        for prompt, prompt_params in zip(prompts, params):
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, prompt, prompt_params)
            request_ids.append(request_id)
        return self._run_engine(request_ids, use_tqdm)

    def chat(self, messages: ChatMessages | Sequence[ChatMessages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.engine.apply_chat_template(
            conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt)}
            for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _params_per_prompt(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                           count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(f"got {len(sampling_params)} sampling params for {count} prompts.")
        return list(sampling_params)

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
