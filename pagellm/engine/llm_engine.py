"""The synchronous engine: prompts in, `RequestOutput`s out, one `step()` at a time."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from pagellm.core.sched_output import SchedulerStats
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core import EngineCore
from pagellm.engine.input_processor import InputProcessor, ProcessedPrompt, PromptType
from pagellm.engine.output_processor import OutputProcessor
from pagellm.lora.request import LoRARequest
from pagellm.outputs import RequestOutput
from pagellm.platform import default_device
from pagellm.request import RequestStatus, child_request_id
from pagellm.sampling_params import OutputKind, SamplingParams
from pagellm.chat_template import load_chat_template
from pagellm.tokenizer import apply_chat_template


def resolve_device(name: str) -> torch.device:
    return default_device() if name == "auto" else torch.device(name)


class LLMEngine:
    """Engine core in this process; `AsyncLLM` runs it in its own process for the server."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        if args.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs in `pagellm serve` (one API server "
                             "over several engine cores); the offline LLM has one engine core.")
        self.core = EngineCore(args.model_config(), args.cache_config(), args.scheduler_config(),
                               resolve_device(args.device), args.grammar_config(),
                               args.speculative(), args.parallel_config(), args.lora_config())
        loaded = self.core.loaded
        self.tokenizer = loaded.tokenizer
        self.chat_template = load_chat_template(args.chat_template) or loaded.chat_template
        self.info = self.core.model_info()
        self.input_processor = InputProcessor(loaded.text, self.info)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.last_stats: SchedulerStats | None = None

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def apply_chat_template(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        return apply_chat_template(self.tokenizer, messages, chat_template or self.chat_template,
                                   add_generation_prompt)

    def add_request(self, request_id: str, prompt: PromptType | ProcessedPrompt,
                    params: SamplingParams, kind: OutputKind = OutputKind.FINAL_ONLY,
                    arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        if lora_request is not None:  # a bad adapter fails here, in the caller
            self.core.add_lora(lora_request)
        if not isinstance(prompt, ProcessedPrompt):
            prompt = self.input_processor.process_prompt(prompt)
        request = self.input_processor.make_request(request_id, prompt, params, arrival_time,
                                                    lora_request)
        self.output_processor.add_request(request_id, prompt.text, prompt.token_ids,
                                          request.sampling_params, kind, request.arrival_time)
        self.core.add_request(request)

    def add_lora(self, lora_request: LoRARequest) -> None:
        self.core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.core.remove_lora(lora_int_id)

    def abort_request(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Abort requests (and their n siblings); returns their final outputs."""
        outputs = []
        for request_id in request_ids:
            output = self.output_processor.abort(request_id)
            if output is None:
                continue
            outputs.append(output)
            ids = [child_request_id(request_id, i) for i in range(len(output.outputs))]
            self.core.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        updates, self.last_stats = self.core.step()
        outputs, stopped = self.output_processor.process(updates)
        self.core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs
