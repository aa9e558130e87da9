"""The engine for the server: the core runs in its own process, requests are async streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagellm.engine.arg_utils import EngineArgs
from pagellm.distributed.config import DataParallelConfig
from pagellm.engine.client_hub import FrontEndPlace
from pagellm.engine.core_client import (AddLoRA, AttachedEngineCoreClient, EngineCoreClient,
                                        KVCacheReport, RemoveLoRA, StepResult)
from pagellm.engine.core_process import EnginePlace, StartedCore
from pagellm.engine.input_processor import InputProcessor, ProcessedPrompt, PromptType
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.tokenizer_pool import TokenizerPool
from pagellm.logger import init_logger
from pagellm.lora.request import LoRARequest
from pagellm.metrics.loggers import (LOG_INTERVAL_SECONDS, LoggingStatLogger,
                                     PrometheusStatLogger, StatLogger)
from pagellm.metrics.stats import IterationStats
from pagellm.model.text import load_early_tokenizer, model_text, tokenizer_for
from pagellm.outputs import RequestOutput
from pagellm.request import RequestStatus, child_request_id
from pagellm.sampling_params import OutputKind, SamplingParams
from pagellm.chat_template import load_chat_template
from pagellm.tokenizer import apply_chat_template

if TYPE_CHECKING:
    from pagellm.distributed.data_parallel import DataParallelCoreClient

logger = init_logger(__name__)


class EngineDeadError(RuntimeError):
    pass


class RequestFailedError(RuntimeError):
    """Processing one request's output failed; it was logged (with its traceback) here."""


class AsyncLLM:
    """`default_start`: how the engine core process starts unless VLLM_WORKER_MULTIPROC_METHOD
    says otherwise (`spawn`, safe in any process; the server asks for `fork`).
    `wait=False` returns once the engine core processes are started; `wait_ready()` then
    waits for their load, so that the server imports its front end meanwhile. `front_end`:
    this is one of several API server processes, attached to engine cores already started.
    `started`: the one engine core's process, started already (`pagellm serve` forks it
    before importing torch). The event loop that runs `wait_ready()` (or else the first
    request) reads the engine cores' results; one loop serves an AsyncLLM for its life."""

    def __init__(self, args: EngineArgs, log_stats: bool = True,
                 default_start: str = "spawn", wait: bool = True,
                 front_end: FrontEndPlace | None = None,
                 started: StartedCore | None = None) -> None:
        self.args = args
        self._log_stats = log_stats
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._dead = False
        self._closing = False
        data_parallel = DataParallelConfig.from_args(args)
        self.engines = list(data_parallel.served_ranks)
        self.client = self._start_client(args, data_parallel, default_start, front_end, started)
        self._front_end = front_end
        self._death_callbacks: list[Callable[[], None]] = []
        self._log_task: asyncio.Task | None = None
        self.lora_adapters: dict[str, LoRARequest] = {}  # by name: what `model` may select
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Once the engine cores have loaded: the tokenizer (loaded here while they load),
        processors and stat loggers."""
        args = self.args
        try:
            early = load_early_tokenizer(args.model, args.tokenizer, args.model_config().formats())
            ready = self.client.wait_ready()
            spec = ready.info.tokenizer_spec
            text = model_text(tokenizer_for(spec, early), spec, ready.info.model_type)
        except BaseException:
            self.client.shutdown()
            raise
        self.info = ready.info
        self.model_path = Path(ready.model_path)
        self.tokenizer = text.tokenizer
        self.chat_template = load_chat_template(args.chat_template) or text.chat_template
        self.input_processor = InputProcessor(text, self.info)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.tokenizer_pool = TokenizerPool(self.tokenizer)
        self.model_name = args.served_model_name or args.model or self.model_path.name
        self.stat_loggers: list[StatLogger] = (self._make_stat_loggers(args, self._front_end)
                                               if self._log_stats else [])
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # outside a loop: reading starts with the first request
            return
        self.client.start_reading(self._loop)

    def _make_stat_loggers(self, args: EngineArgs,
                           front_end: FrontEndPlace | None) -> list[StatLogger]:
        """A log line per engine and vLLM's metrics. Of several API server processes, only
        one logs the line and records the engines' own figures; each records its requests'."""
        engine_stats = front_end is None or front_end.records_engine_stats
        kv_label = "GPU KV cache usage" if args.device == "cuda" else "KV cache usage"
        lines = [LoggingStatLogger(kv_label, engine, engine_tokens=front_end is not None)
                 for engine in self.engines] if engine_stats else []
        return [*lines, *PrometheusStatLogger.for_engines(self.model_name, self.engines,
                                                          engine_stats=engine_stats)]

    def _start_client(self, args: EngineArgs, data_parallel: DataParallelConfig,
                      default_start: str, front_end: FrontEndPlace | None,
                      started: StartedCore | None) -> "EngineCoreClient | DataParallelCoreClient":
        if len(self.engines) == 1 and front_end is not None:
            return AttachedEngineCoreClient(front_end.conns[0], "the server's engine",
                                            self._on_result, self._on_dead)
        if len(self.engines) == 1:
            return EngineCoreClient(args, self._on_result, self._on_dead,
                                    EnginePlace(self.engines[0], data_parallel.size),
                                    default_start=default_start, started=started)
        from pagellm.distributed.data_parallel import DataParallelCoreClient

        return DataParallelCoreClient(args, data_parallel, self._on_result, self._on_dead,
                                      default_start, front_end.conns if front_end else None)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, log_stats: bool = True,
                         default_start: str = "spawn", wait: bool = True,
                         front_end: FrontEndPlace | None = None,
                         started: StartedCore | None = None) -> "AsyncLLM":
        return cls(args, log_stats, default_start, wait, front_end, started)

    @property
    def errored(self) -> bool:
        return self._dead

    def apply_chat_template(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        return apply_chat_template(self.tokenizer, messages, chat_template or self.chat_template,
                                   add_generation_prompt, **kwargs)

    async def encode(self, text: str, add_special_tokens: bool = True,
                     limit: int | None = None) -> list[int]:
        """Off the event loop for large texts; PromptTooLong past `limit` tokens."""
        return await self.tokenizer_pool.encode(text, add_special_tokens, limit)

    async def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                          limit: int | None = None, **template_kwargs: Any) -> list[int]:
        """`apply_chat_template` off the event loop for large conversations."""
        return await self.tokenizer_pool.render_chat(messages, self.chat_template,
                                                     add_generation_prompt, template_kwargs, limit)

    async def decode(self, token_ids: list[int]) -> str:
        return await self.tokenizer_pool.decode(token_ids)

    async def check_kv_cache(self) -> KVCacheReport:
        """Block usage and the block pool's integrity check, from the core between steps."""
        if self._dead:
            raise EngineDeadError("the engine core process is not running.")
        self._bind_loop()
        return await asyncio.wrap_future(self.client.check_kv_cache())

    async def add_lora(self, lora_request: LoRARequest, replace: bool = False) -> None:
        """Load and check an adapter in the engine core, then serve it under its name; a
        ValueError says why it cannot be served."""
        await self._lora_call(AddLoRA(lora_request, replace))
        self.lora_adapters[lora_request.lora_name] = lora_request

    async def remove_lora(self, lora_name: str) -> None:
        lora_request = self.lora_adapters.pop(lora_name)
        await self._lora_call(RemoveLoRA(lora_request.lora_int_id))

    async def _lora_call(self, message: AddLoRA | RemoveLoRA) -> None:
        if self._dead:
            raise EngineDeadError("the engine core process is not running.")
        self._bind_loop()
        reply = await asyncio.wrap_future(self.client.lora_call(message))
        if reply.error is not None:
            raise ValueError(reply.error)

    def on_death(self, callback: Callable[[], None]) -> None:
        """Run `callback` on the event loop once the engine core dies (after failing requests)."""
        self._bind_loop()
        self._death_callbacks.append(callback)

    async def generate(self, prompt: PromptType | ProcessedPrompt, params: SamplingParams,
                       request_id: str, lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream delta outputs; leaving the loop early aborts the request and frees its blocks."""
        if self._dead:
            raise EngineDeadError("the engine core process is not running.")
        self._bind_loop()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use.")
        if not isinstance(prompt, ProcessedPrompt):
            prompt = self.input_processor.process_prompt(prompt)
        request = self.input_processor.make_request(request_id, prompt, params,
                                                    lora_request=lora_request)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self.output_processor.add_request(request_id, prompt.text, prompt.token_ids,
                                          request.sampling_params, OutputKind.DELTA,
                                          request.arrival_time)
        self.client.add_request(request)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._abort(request_id)

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        output = self.output_processor.abort(request_id)
        if output is None or self._dead:
            return
        ids = [child_request_id(request_id, i) for i in range(len(output.outputs))]
        self.client.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(output)

    def _bind_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self.client.start_reading(self._loop)
        if self.stat_loggers and self._log_task is None:
            self._log_task = self._loop.create_task(self._log_periodically())

    def _on_result(self, result: StepResult) -> None:
        """On the event loop, which reads the engine cores' connections."""
        iteration = IterationStats()
        failed: dict[str, Exception] = {}
        outputs, stopped = self.output_processor.process(result.updates, iteration, failed)
        self.client.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for request_id, error in failed.items():
            logger.error("Processing the output of request %s failed; failing that request "
                         "only.", request_id, exc_info=error)
            queue = self._queues.get(request_id)
            if queue is not None:  # its stream raises, and leaving it aborts the request
                queue.put_nowait(RequestFailedError(
                    f"processing the output of request {request_id} failed "
                    f"({type(error).__name__})"))
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
        for stat_logger in self.stat_loggers:
            stat_logger.record(result.stats, iteration, result.engine)

    def _on_dead(self) -> None:
        if self._closing:
            return
        self._dead = True
        logger.error("The engine core process died; failing all requests.")
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError("the engine core process died."))
        for callback in self._death_callbacks:
            callback()

    async def _log_periodically(self) -> None:
        while True:
            await asyncio.sleep(LOG_INTERVAL_SECONDS)
            for stat_logger in self.stat_loggers:
                stat_logger.log()

    def shutdown(self) -> None:
        self._closing = True
        if self._log_task is not None:
            self._log_task.cancel()
        if hasattr(self, "tokenizer_pool"):  # else stopped before the engines were ready
            self.tokenizer_pool.shutdown()
        self.client.shutdown()
