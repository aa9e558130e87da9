"""The engine core: scheduler, KV cache manager and model runner, stepped together.

It deals in `Request` objects and token ids only; text lives outside it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

import torch

from pagellm.config import CacheConfig, ModelConfig, SchedulerConfig
from pagellm.core.block_map import block_map
from pagellm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagellm.core.kv_cache_manager import KVCacheManager, cdiv
from pagellm.core.kv_layout import KVCacheLayout, hybrid_layout
from pagellm.core.offload import OffloadPool, SwapCostModel
from pagellm.core.sched_output import RequestUpdate, SchedulerStats
from pagellm.core.scheduler import Scheduler
from pagellm.distributed.config import ParallelConfig
from pagellm.distributed import start_executor
from pagellm.engine.input_processor import ModelInfo
from pagellm.kernels import cpu_kernels_available
from pagellm.logger import init_logger
from pagellm.lora.config import LoRAConfig
from pagellm.lora.request import LoRARequest
from pagellm.model.loader import LoadedModel, load_model
from pagellm.platform import dtype_name, resolve_dtypes
from pagellm.request import Request, RequestStatus
from pagellm.spec_decode.config import SpeculativeConfig
from pagellm.spec_decode.decoder import SpecDecoder, load_draft_model
from pagellm.structured_outputs.manager import StructuredOutputManager
from pagellm.structured_outputs.params import StructuredOutputsConfig
from pagellm.worker.model_runner import LaunchedStep, ModelRunner

logger = init_logger(__name__)
_GIB = float(1 << 30)
BLOCK_MAP_INTERVAL_SECONDS = 1.0  # a map costs about a millisecond per 10k blocks


class EngineCore:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, device: torch.device,
                 structured_outputs_config: StructuredOutputsConfig | None = None,
                 speculative_config: SpeculativeConfig | None = None,
                 parallel_config: ParallelConfig | None = None,
                 lora_config: LoRAConfig | None = None) -> None:
        start = time.perf_counter()
        self.device = device
        self.dtype, kv_cache_dtype = resolve_dtypes(
            model_config.dtype, cache_config.cache_dtype, device,
            model_config.int8_activations() and model_config.is_gguf())
        if parallel_config is not None and parallel_config.world_size > 1 and (
                speculative_config is not None or lora_config is not None):
            raise ValueError("Speculative decoding and LoRA with tensor or pipeline parallelism "
                             "are not supported by pagellm yet.")
        self.executor = start_executor(parallel_config, cache_config, device)
        self.loaded: LoadedModel = self._load(model_config, kv_cache_dtype,
                                              cache_config.block_size)
        weights_bytes = self.loaded.model.weight_bytes()
        logger.info("Model loading took %.4f GiB and %.6f seconds",
                    weights_bytes / _GIB, time.perf_counter() - start)
        self.max_model_len = resolve_max_model_len(model_config.max_model_len,
                                                   self.loaded.arch.max_position_embeddings)
        scheduler_config.max_model_len = self.max_model_len
        self.cache_config = cache_config
        if kv_cache_dtype != self.dtype:
            logger.info("KV cache dtype: %s (the model computes in %s)",
                        dtype_name(kv_cache_dtype), dtype_name(self.dtype))
        runner_args = (self.loaded.model, self.loaded.arch, cache_config.block_size, device,
                       self.dtype, model_config.seed, kv_cache_dtype,
                       model_config.batch_invariant)
        self.runner = (ModelRunner(*runner_args) if self.executor is None
                       else self.executor.driver_runner(*runner_args))
        self.lora = None
        if lora_config is not None:  # before the KV cache: its slots take memory too
            from pagellm.lora.manager import LoRAModelManager

            self.lora = self.runner.lora = LoRAModelManager(self.loaded.model, lora_config,
                                                            self.dtype, device)
        self.kv_layout = self._kv_layout()
        self.runner.kv_layout = self.kv_layout
        self.num_blocks = self._determine_num_blocks(weights_bytes, scheduler_config)
        logger.info("Allocating the KV cache: %s blocks of %s tokens", f"{self.num_blocks:,}",
                    cache_config.block_size)
        self.runner.allocate_kv_cache(self.num_blocks)
        offload = self._make_offload_pool()
        measure = offload is not None and scheduler_config.preemption_mode == "auto"
        swap_cost = self._measure_swap_cost() if measure else None
        kv_cache_manager = self._make_kv_cache_manager(offload)
        # pipeline parallelism: up to one batch in flight per stage (step_with_batch_queue)
        self.batch_queue_size = (1 if self.executor is None
                                 else self.executor.max_concurrent_batches)
        self.batch_queue: deque[LaunchedStep] = deque()
        self.num_batches = self.num_overlapped_batches = 0
        self.scheduler = Scheduler(scheduler_config, kv_cache_manager, swap_cost,
                                   self.batch_queue_size)
        self.spec_decoder = (self._make_spec_decoder(speculative_config, model_config,
                                                     kv_cache_dtype)
                             if speculative_config is not None else None)
        self._failed: list[Request] = []  # requests whose adapter failed to load
        self._block_map_time = float("-inf")
        self.structured_outputs = StructuredOutputManager(
            lambda: self.loaded.text, self.loaded.arch.vocab_size, structured_outputs_config)

    def _load(self, config: ModelConfig, kv_cache_dtype: torch.dtype,
              block_size: int) -> LoadedModel:
        """Load with a line before each long stage, so that a first start is never silent."""
        if self.device.type == "cpu":
            start = time.perf_counter()
            logger.info("Preparing the CPU kernels (compiled once per machine, then cached)")
            ready = cpu_kernels_available()
            logger.info("CPU kernels %s in %.1f seconds", "ready" if ready else "unavailable",
                        time.perf_counter() - start)
        logger.info("Loading %s in %s", config.model or "the embedded model",
                    dtype_name(self.dtype))
        if self.executor is not None:  # each rank loads its own shard
            return self.executor.load(config, self.dtype, kv_cache_dtype, block_size)
        return load_model(config.model, self.dtype, self.device, config.tokenizer,
                          config.gguf_quantized_max_tokens, config.int8_activations(),
                          config.batch_invariant, formats=config.formats())

    def _make_spec_decoder(self, config: SpeculativeConfig, model_config: ModelConfig,
                           kv_cache_dtype: torch.dtype) -> SpecDecoder:
        draft = None
        if config.method == "draft_model":
            draft = load_draft_model(config, self.loaded, self.num_blocks,
                                     self.cache_config.block_size, self.device, self.dtype,
                                     kv_cache_dtype, model_config.batch_invariant,
                                     model_config.seed)
        logger.info("Speculative decoding: %s, up to %d tokens per step%s", config.method,
                    config.num_speculative_tokens,
                    "" if config.disable_adaptive else ", fewer or none where they do not pay")
        return SpecDecoder(config, self.max_model_len, draft)

    def _gpu_kv_cache_bytes(self, weights_bytes: int, scheduler_config: SchedulerConfig) -> int:
        peak = self.runner.profile_peak_bytes(
            min(scheduler_config.max_num_batched_tokens, self.max_model_len))
        free, total = torch.cuda.mem_get_info(self.device)
        cache = self.cache_config
        available = cache.gpu_kv_cache_bytes(total, weights_bytes, peak, free)
        # a lone engine's cap sits below its share by about the CUDA context: no warning then
        if available < cache.wanted_gpu_kv_cache_bytes(total, weights_bytes, peak) - _GIB:
            logger.warning("Only %.2f GiB of the GPU is free (other processes or engines hold "
                           "the rest): the KV cache gets %.2f GiB, less than asked",
                           free / _GIB, available / _GIB)
        return available

    def _determine_num_blocks(self, weights_bytes: int, scheduler_config: SchedulerConfig) -> int:
        cache = self.cache_config
        block_bytes = self.runner.block_bytes()
        if cache.num_gpu_blocks_override is not None:
            available = cache.num_gpu_blocks_override * block_bytes
        elif self.device.type == "cuda":
            available = self._gpu_kv_cache_bytes(weights_bytes, scheduler_config)
        else:
            available = cache.cpu_kv_cache_bytes()
        num_blocks = max(0, available // block_bytes)
        layout, chunk = self.kv_layout, scheduler_config.max_num_batched_tokens
        logger.info("Available KV cache memory: %.2f GiB", available / _GIB)
        prefix = "GPU " if self.device.type == "cuda" else ""
        if layout is None:
            per_request = cdiv(self.max_model_len, cache.block_size)
            usable, largest = num_blocks, num_blocks * cache.block_size
            logger.info("%sKV cache size: %s tokens", prefix, f"{largest:,}")
        else:  # vLLM's count: the tokens every group could hold; block 0 is the null block
            per_request = layout.blocks_per_request(self.max_model_len, cache.block_size, chunk)
            usable = max(0, num_blocks - 1)
            largest = layout.max_tokens(usable, cache.block_size, chunk)
            tokens = usable // layout.num_groups * cache.block_size
            logger.info("%sKV cache size: %s tokens (%s in one request: sliding-window layers "
                        "keep their window only)", prefix, f"{tokens:,}", f"{largest:,}")
            every_block = (cdiv(self.max_model_len, cache.block_size)
                           * self.loaded.arch.num_hidden_layers
                           * (block_bytes // layout.num_tensors))
            logger.info("KV cache of one %s-token request: %.2f GiB (%.2f GiB with every block)",
                        f"{self.max_model_len:,}", per_request * block_bytes / _GIB,
                        every_block / _GIB)
        self._check_fits(per_request, usable, block_bytes, available, largest)
        logger.info("Maximum concurrency for %s tokens per request: %.2fx",
                    f"{self.max_model_len:,}", usable / per_request)
        return num_blocks

    def _kv_layout(self) -> KVCacheLayout | None:
        """Layer groups with block tables of their own where the model has sliding-window
        layers (vLLM's hybrid KV cache manager); None: every layer keeps every block. Off with
        KV offloading, as vLLM's is with KV connectors, and under parallelism (not there yet)."""
        arch, cache = self.loaded.arch, self.cache_config
        layout = hybrid_layout(arch.layer_types, arch.sliding_window, self.max_model_len)
        if layout is None or cache.disable_hybrid_kv_cache_manager:
            return None
        if cache.offload_bytes or self.executor is not None:
            logger.info("Sliding-window layers keep every KV block: the hybrid KV cache manager "
                        "does not support %s yet",
                        "KV offloading" if cache.offload_bytes else "parallelism")
            return None
        logger.info("Hybrid KV cache manager: %s; blocks that leave every query's window are "
                    "given back", layout.describe())
        return layout

    def _make_kv_cache_manager(self, offload: OffloadPool | None) -> KVCacheManager:
        cache = self.cache_config
        if self.kv_layout is None:
            return KVCacheManager(self.num_blocks, cache.block_size, cache.enable_prefix_caching,
                                  offload)
        return HybridKVCacheManager(self.num_blocks, cache.block_size, self.kv_layout,
                                    cache.enable_prefix_caching)

    def _make_offload_pool(self) -> OffloadPool | None:
        """The second KV tier, if configured: as many blocks as its bytes hold."""
        cache = self.cache_config
        if not cache.offload_bytes:
            return None
        block_bytes = self.runner.block_bytes()
        num_blocks = cache.offload_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(f"the KV offloading size ({cache.offload_bytes} bytes) is smaller "
                             f"than one KV block ({block_bytes} bytes).")
        self.runner.allocate_offload_cache(num_blocks, cache.offload_path)
        if cache.offload_path is not None:
            where = f"memory-mapped file {cache.offload_path}"
        else:
            where = "pinned host memory" if self.device.type == "cuda" else "host memory"
        logger.info("KV offloading tier: %s blocks, %s tokens, %.2f GiB in %s",
                    f"{num_blocks:,}", f"{num_blocks * cache.block_size:,}",
                    num_blocks * block_bytes / _GIB, where)
        return OffloadPool(num_blocks, block_bytes)

    def _measure_swap_cost(self) -> SwapCostModel:
        """Rates for choosing swap or recompute, measured once: a timed matmul for compute, a
        one-block and a multi-block copy between the tiers for fixed cost and bandwidth."""
        latency, bandwidth = self.runner.measure_copy_cost()
        flops = self.runner.measure_flops()
        arch = self.loaded.arch
        logger.info("Preemption cost model: %.1f GFLOP/s compute, %.2f GB/s and %.1f us per "
                    "KV transfer", flops / 1e9, bandwidth / 1e9, latency * 1e6)
        return SwapCostModel(
            num_params=self.loaded.model.num_weights(),
            attention_width=arch.num_hidden_layers * arch.num_attention_heads * arch.head_dim,
            block_bytes=self.runner.block_bytes(), flops_per_second=flops,
            copy_latency=latency, copy_bytes_per_second=bandwidth)

    def _check_fits(self, needed_blocks: int, num_blocks: int, block_bytes: int, available: int,
                    largest: int) -> None:
        """One request of max_model_len tokens must fit, or we fail now rather than hang later."""
        if num_blocks >= needed_blocks:
            return
        raise ValueError(
            f"To serve at least one request with the model's max seq len ({self.max_model_len}), "
            f"{needed_blocks * block_bytes / _GIB:.2f} GiB KV cache is needed, which is larger "
            f"than the available KV cache memory ({available / _GIB:.2f} GiB). Based on the "
            f"available memory, the largest max_model_len that fits is {largest}. Try increasing "
            "the KV cache memory (kv_cache_memory / gpu_memory_utilization) or setting "
            f"max_model_len to at most {largest}.")

    def model_info(self) -> ModelInfo:
        return ModelInfo(max_model_len=self.max_model_len, vocab_size=self.loaded.arch.vocab_size,
                         model_type=self.loaded.arch.model_type,
                         tokenizer_spec=self.loaded.tokenizer_spec, num_kv_blocks=self.num_blocks)

    def add_request(self, request: Request) -> None:
        """A request whose adapter fails to load (evicted from the LRU, then its files
        changed) is logged and aborted at the next step."""
        if request.lora_request is not None:
            try:
                request.lora = self._lora().attach(request.lora_request)
            except ValueError as error:
                logger.error("Request %s: %s", request.request_id, error)
                self._failed.append(request)
                return
        if request.sampling_params.structured_outputs is not None:
            self.structured_outputs.attach(request)
        self.scheduler.add_request(request)

    def _lora(self):
        if self.lora is None:
            raise ValueError("LoRA is not enabled: start the engine with enable_lora "
                             "(--enable-lora).")
        return self.lora

    def add_lora(self, lora_request: LoRARequest, replace: bool = False) -> None:
        """Load and check an adapter now (a ValueError says why it cannot be served)."""
        self._lora().add_lora(lora_request, replace)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._lora().remove_lora(lora_int_id)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return (bool(self._failed) or self.scheduler.has_unfinished_requests()
                or bool(self.batch_queue))

    def step(self) -> tuple[list[RequestUpdate], SchedulerStats]:
        if self.batch_queue_size > 1:
            return self.step_with_batch_queue()
        failed = self._finish_failed_grammars() + self._finish_failed_loras()
        if self.spec_decoder is not None:
            self.spec_decoder.propose(self.scheduler.running, set(self.scheduler.requests))
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty and not scheduled.has_transfers:
            self.structured_outputs.wait_for_any(list(self.scheduler.waiting))
            return failed, self.make_stats()
        start = time.perf_counter()
        runner_output = self.runner.execute(scheduled)
        if self.spec_decoder is not None:
            self.spec_decoder.observe(scheduled, runner_output, time.perf_counter() - start)
        updates = self.scheduler.update_from_output(scheduled, runner_output)
        return failed + updates, self.make_stats()

    def step_with_batch_queue(self) -> tuple[list[RequestUpdate], SchedulerStats]:
        """A step under pipeline parallelism: schedule a batch (of requests not in flight)
        and launch it without waiting (stage 0 computes it here and sends its hidden states
        on, while the later stages compute the batches before it); only when the queue is as
        deep as the pipeline, or nothing more could be scheduled, wait for the oldest batch's
        logits from the last stage, sample it and update the scheduler."""
        updates = self._finish_failed_grammars() + self._finish_failed_loras()
        scheduled = self.scheduler.schedule()
        launched = not scheduled.is_empty or scheduled.has_transfers
        if launched:
            self.num_overlapped_batches += bool(self.batch_queue)
            self.num_batches += 1
            self.batch_queue.append(self.runner.launch(scheduled))
        depth = len(self.batch_queue)
        if depth == self.batch_queue_size or (depth and not launched):
            oldest = self.batch_queue.popleft()
            updates += self.scheduler.update_from_output(oldest.step, self.runner.finish(oldest))
        elif not launched:
            self.structured_outputs.wait_for_any(list(self.scheduler.waiting))
        stats = self.make_stats()
        stats.batches_in_flight = depth
        return updates, stats

    def _finish_failed_grammars(self) -> list[RequestUpdate]:
        """Waiting requests whose grammar failed to compile (or timed out) end as aborted."""
        now = time.monotonic()
        updates = []
        for request in list(self.scheduler.waiting):
            reason = request.grammar.failure(now) if request.grammar is not None else None
            if reason is None:
                continue
            logger.error("Request %s: %s", request.request_id, reason)
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
            updates.append(RequestUpdate(request.request_id, request.parent_id, request.index,
                                         [], [], request.status.finish_reason))
        return updates

    def _finish_failed_loras(self) -> list[RequestUpdate]:
        failed, self._failed = self._failed, []
        return [RequestUpdate(r.request_id, r.parent_id, r.index, [], [],
                              RequestStatus.FINISHED_ABORTED.finish_reason) for r in failed]

    def make_stats(self) -> SchedulerStats:
        """The scheduler's record, with a map of the KV blocks once a second and whenever the
        engine falls idle (so the last map shown is never one of a busy cache)."""
        stats = self.scheduler.make_stats()
        stats.batches_in_flight = len(self.batch_queue)
        stats.num_batches = self.num_batches
        stats.num_overlapped_batches = self.num_overlapped_batches
        if self.spec_decoder is not None:
            stats.spec_decoding = self.spec_decoder.stats.copy()
        if self.lora is not None:
            stats.lora = self.lora.stats(self.scheduler.running, self.scheduler.waiting)
        now = time.monotonic()
        idle = not self.has_unfinished_requests()
        if idle or now - self._block_map_time >= BLOCK_MAP_INTERVAL_SECONDS:
            kv = self.scheduler.kv
            stats.block_map = block_map(kv.pool, kv.offload)
            self._block_map_time = now
        return stats


def resolve_max_model_len(requested: int | None, model_max: int) -> int:
    if requested is None:
        return model_max
    if requested < 2:
        raise ValueError(f"max_model_len must be at least 2, got {requested}.")
    if requested > model_max:
        raise ValueError(
            f"max_model_len ({requested}) is greater than the model's maximum context length "
            f"({model_max}, max_position_embeddings).")
    return requested
