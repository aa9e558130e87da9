"""Turns a scheduled step into tensors, runs the model, samples.

The scheduler speaks in request objects and integers; this is the only place
where a step becomes tensors: flat token ids and positions for the whole
batch, the slot of each new token in the paged KV cache, and the attention
metadata built once and shared by every layer. The KV cache's tensors, both
tiers, and the copies between them: kv_tiers.py.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagellm.core.kv_layout import KVCacheLayout
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.kernels import (cache_kernels_available, cpu_kernels_available,
                             on_demand_kernels_available)
from pagellm.logger import init_logger
from pagellm.model.arch import ArchConfig
from pagellm.model.attention import AttentionMetadata, build_attention_metadata
from pagellm.logprobs import TokenLogprobs
from pagellm.sample import Sampler, SamplingRow, build_sampling_metadata
from pagellm.sample.metadata import TokenMaskMetadata, build_token_mask
from pagellm.sample.prompt_logprobs import hand_out_prompt_logprobs, score_prompt_rows
from pagellm.spec_decode.verify import draft_sampling_rows, verify_drafts
from pagellm.worker.kv_groups import layer_metadata
from pagellm.worker.kv_tiers import KVTiers
from pagellm.worker.step_chunk import StepChunk, step_chunks

if TYPE_CHECKING:
    from pagellm.lora.manager import LoRAModelManager

logger = init_logger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    output_rows: torch.Tensor  # the last token of each item that samples
    # for each sample, its row of output_rows; None when each item samples once
    sample_rows: torch.Tensor | None
    num_sampling_rows: int = 0  # output_rows past these are scored for prompt logprobs
    score_targets: torch.Tensor | None = None  # the prompt token each scored row scores
    score_top: list[int] | None = None  # the top-k of each scored row


@dataclass
class StepLogits:
    """What a step's forward yields: the sampling rows' logits (a row per sample) and the
    prompt logprobs of the scored rows, in chunk order; None where there are none (or, under
    parallelism, on a rank that does not sample)."""

    sampling: torch.Tensor | None = None
    prompt: list[TokenLogprobs] | None = None


@dataclass
class LaunchedStep:
    """A step between `launch` and `finish`: its inputs and this rank's forward output (the
    output rows' hidden states), the sampling rows and their owners, the grammar masks."""

    step: SchedulerOutput
    output: ModelRunnerOutput
    forward: tuple[StepInputs, torch.Tensor] | None = None  # None: nothing to compute
    rows: list[SamplingRow] = field(default_factory=list)
    owners: list[str] = field(default_factory=list)
    token_mask: Future[TokenMaskMetadata | None] | None = None


class ModelRunner(KVTiers):
    def __init__(self, model: torch.nn.Module, arch: ArchConfig, block_size: int,
                 device: torch.device, dtype: torch.dtype, seed: int,
                 kv_cache_dtype: torch.dtype | None = None,
                 batch_invariant: bool = False) -> None:
        self.model = model
        self.batch_invariant = batch_invariant
        self.arch = arch
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.kv_caches: list[torch.Tensor] = []
        self._unfaulted = iter(())
        self.offload_caches: list[torch.Tensor] = []
        self.kv_layout: KVCacheLayout | None = None  # set by the engine core: layer groups
        self.sampler = Sampler()
        # fills the step's grammar bitmasks while the forward runs (the libraries release the GIL)
        self._token_masks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="token-mask")
        self.lora: LoRAModelManager | None = None  # set by the engine core with --enable-lora
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        if device.type == "cpu":  # build (or load) the kernels now, not at the first step
            cache_kernels_available(self.kv_cache_dtype)
            logger.info("Decode attention: %s", _decode_attention_name(self.batch_invariant))

    @torch.inference_mode()
    def measure_flops(self) -> float:
        """Matmul flops per second in the model's dtype: the fastest of three runs (the first
        warms up) of a square matmul big enough to keep the device busy (2 n^3 flops)."""
        size = 4096 if self.device.type == "cuda" else 512
        matrix = torch.randn(size, size, dtype=self.dtype, device=self.device)
        seconds = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            torch.matmul(matrix, matrix)
            self._synchronize()
            seconds = min(seconds, time.perf_counter() - start)
        return 2 * size ** 3 / max(seconds, 1e-9)

    @torch.inference_mode()
    def profile_peak_bytes(self, num_tokens: int) -> int:
        """Peak activation memory of a forward pass over `num_tokens` prompt tokens (CUDA only)."""
        blocks = -(-num_tokens // self.block_size)
        self.allocate_kv_cache(blocks)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        slots = torch.arange(num_tokens, device=self.device)
        metadata = build_attention_metadata([num_tokens], [num_tokens], [list(range(blocks))],
                                            slots, self.block_size, self.device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        hidden = self.model(ids, slots, self.kv_caches, metadata)
        self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.kv_caches = []
        torch.cuda.empty_cache()
        return peak

    def prepare_inputs(self, chunks: list[StepChunk]) -> StepInputs:
        token_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        output_rows: list[int] = []
        sample_rows: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for chunk in chunks:
            start, count = chunk.start, len(chunk.token_ids)
            token_ids.extend(chunk.token_ids)
            pos = np.arange(start, start + count, dtype=np.int64)
            blocks = np.asarray(chunk.block_ids, dtype=np.int64)[pos // self.block_size]
            positions.append(pos)
            slots.append(blocks * self.block_size + pos % self.block_size)
            query_lens.append(count)
            seq_lens.append(start + count)
            if chunk.num_samples:  # with drafts, each of them is sampled (verified) too
                for row in range(len(token_ids) - 1 - chunk.num_draft_tokens, len(token_ids)):
                    sample_rows.extend([len(output_rows)] * chunk.num_samples)
                    output_rows.append(row)
        device = self.device
        num_sampling_rows = len(output_rows)
        score_targets, score_top = self._score_rows(chunks, query_lens, output_rows)
        slot_mapping = np.concatenate(slots)
        write_rows = self._kv_write_rows(chunks, query_lens)
        if write_rows is not None:
            slot_mapping = slot_mapping[write_rows]
        metadata = build_attention_metadata(
            query_lens, seq_lens, [chunk.block_ids for chunk in chunks],
            torch.from_numpy(slot_mapping).to(device), self.block_size, device,
            self.batch_invariant,
            None if write_rows is None else torch.from_numpy(write_rows).to(device))
        if self.kv_layout is not None:
            metadata.layer_metadata = layer_metadata(metadata, self.kv_layout, chunks, positions,
                                                     write_rows, self.block_size)
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
            positions=torch.from_numpy(np.concatenate(positions)).to(device),
            metadata=metadata,
            output_rows=torch.tensor(output_rows, dtype=torch.long, device=device),
            sample_rows=(None if len(sample_rows) == num_sampling_rows else
                         torch.tensor(sample_rows, dtype=torch.long, device=device)),
            num_sampling_rows=num_sampling_rows,
            score_targets=(torch.tensor(score_targets, dtype=torch.long, device=device)
                           if score_targets else None),
            score_top=score_top)

    @staticmethod
    def _score_rows(chunks: list[StepChunk], query_lens: list[int],
                    output_rows: list[int]) -> tuple[list[int], list[int]]:
        """Append the rows scored for prompt logprobs to `output_rows`, after the sampling
        rows; -> the prompt token each scores and its top-k."""
        targets: list[int] = []
        tops: list[int] = []
        first = 0
        for chunk, count in zip(chunks, query_lens):
            if chunk.score_targets:
                begin = first + chunk.score_offset
                output_rows.extend(range(begin, begin + len(chunk.score_targets)))
                targets.extend(chunk.score_targets)
                tops.extend([chunk.num_prompt_logprobs] * len(chunk.score_targets))
            first += count
        return targets, tops

    @staticmethod
    def _kv_write_rows(chunks: list[StepChunk], query_lens: list[int]) -> np.ndarray | None:
        """The tokens whose K/V the step writes; None when it writes all of them."""
        if not any(chunk.num_kv_reused for chunk in chunks):
            return None
        rows = []
        first = 0
        for chunk, count in zip(chunks, query_lens):
            rows.append(np.arange(first + chunk.num_kv_reused, first + count, dtype=np.int64))
            first += count
        return np.concatenate(rows)

    @torch.inference_mode()
    def compute(self, chunks: list[StepChunk], lora_slots: np.ndarray | None = None) -> StepLogits:
        """Run the step's forward and LM head. `lora_slots`: each token's adapter slot, with
        --enable-lora. Every rank makes the same LM-head calls: under parallelism they are
        collective."""
        return self._logits(*self._forward(chunks, lora_slots))

    def _forward(self, chunks: list[StepChunk],
                 lora_slots: np.ndarray | None) -> tuple[StepInputs, torch.Tensor]:
        inputs = self.prepare_inputs(chunks)
        if lora_slots is not None:
            self.lora.set_step(lora_slots, inputs.output_rows)
        try:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                                inputs.metadata, inputs.output_rows)
        finally:
            if lora_slots is not None:
                self.lora.end_step()
        return inputs, hidden

    def _logits(self, inputs: StepInputs, hidden: torch.Tensor) -> StepLogits:
        result = StepLogits()
        num_sampling = inputs.num_sampling_rows
        if num_sampling:
            logits = self.model.compute_logits(hidden[:num_sampling])
            if logits is not None and inputs.sample_rows is not None:
                logits = logits[inputs.sample_rows]  # n > 1: the samples of one item share logits
            result.sampling = logits
        if inputs.score_targets is not None:
            result.prompt = score_prompt_rows(self.model.compute_logits, hidden[num_sampling:],
                                              inputs.score_targets, inputs.score_top or [])
        return result

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return self.finish(self.launch(step))

    @torch.inference_mode()
    def launch(self, step: SchedulerOutput) -> LaunchedStep:
        """The step up to the end of this rank's forward (under pipeline parallelism, stage 0's:
        its hidden states are then on their way to the next stage, and the engine core's batch
        queue may launch another step before it finishes this one)."""
        launched = LaunchedStep(step, ModelRunnerOutput(transfers=self._transfer(step)))
        if step.is_empty:
            return launched
        lora_slots = None
        if self.lora is not None:  # each item's adapter slot, then each token's
            slots = self.lora.activate([s.request.lora for s in step.scheduled])
            lora_slots = np.repeat(slots, [s.num_tokens for s in step.scheduled])
        launched.rows, launched.owners = self._sampling_rows(step)
        if any(row.grammar is not None for row in launched.rows):
            launched.token_mask = self._token_masks.submit(
                build_token_mask, launched.rows, self.arch.vocab_size, self.device)
        try:
            launched.forward = self._forward(step_chunks(step), lora_slots)
        finally:  # the matchers are the scheduler's again once this returns
            if launched.token_mask is not None:
                wait([launched.token_mask])
        return launched

    @torch.inference_mode()
    def finish(self, launched: LaunchedStep) -> ModelRunnerOutput:
        """The launched step's logits (under pipeline parallelism, received from the last
        stage), its prompt logprobs and its sampled tokens."""
        step, output = launched.step, launched.output
        if launched.forward is None:
            return output
        computed = self._logits(*launched.forward)
        if computed.prompt is not None:
            hand_out_prompt_logprobs(step, computed.prompt, output.prompt_logprobs)
        logits = computed.sampling
        if logits is None:
            return output
        metadata = build_sampling_metadata(launched.rows, logits.shape[-1], self.device,
                                           launched.token_mask)
        sampled = self.sampler(logits, metadata, self.generator)
        for request_id, token_id, logprob in zip(launched.owners, sampled.token_ids,
                                                 sampled.logprobs):
            output.sampled.setdefault(request_id, []).append(token_id)
            output.logprobs.setdefault(request_id, []).append(logprob)
        if step.has_drafts:
            verify_drafts(step, output, logits, metadata, self.generator)
        return output

    @staticmethod
    def _sampling_rows(step: SchedulerOutput) -> tuple[list[SamplingRow], list[str]]:
        rows: list[SamplingRow] = []
        owners: list[str] = []
        for item in step.scheduled:
            if not item.samples:
                continue
            request = item.request
            if item.num_draft_tokens:
                rows.extend(draft_sampling_rows(item))
                owners.extend([request.request_id] * (item.num_draft_tokens + 1))
                continue
            for stream in range(item.num_samples):
                rows.append(SamplingRow(
                    params=request.sampling_params, prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids, eos_token_id=request.eos_token_id,
                    seed_stream=request.index + stream, grammar=request.grammar))
                owners.append(request.request_id)
        return rows, owners


def _decode_attention_name(batch_invariant: bool) -> str:
    if not cpu_kernels_available():
        return "torch ops (no CPU kernel)"
    if batch_invariant:
        return "pagellm's paged CPU kernel, bit-identical to its prefill kernel (batch-invariant)"
    if not on_demand_kernels_available():  # its kernel is built on demand: now, not at a step
        return "torch ops (the CPU kernel did not build)"
    return "pagellm's paged CPU kernel"
