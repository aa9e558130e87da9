"""Turns a scheduled step into tensors, runs the model, samples.

The scheduler speaks in request objects and integers; this is the only place
where a step becomes tensors: flat token ids and positions for the whole
batch, the slot of each new token in the paged KV cache, and the attention
metadata built once and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.model.arch import ArchConfig
from pagellm.model.attention import AttentionMetadata, build_attention_metadata
from pagellm.sample import Sampler, SamplingRow, build_sampling_metadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor


class ModelRunner:
    def __init__(self, model: torch.nn.Module, arch: ArchConfig, block_size: int,
                 device: torch.device, dtype: torch.dtype, seed: int) -> None:
        self.model = model
        self.arch = arch
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def block_bytes(self) -> int:
        """Bytes of one block across all layers: 2 x block_size x kv_heads x head_dim x dtype x layers."""
        arch = self.arch
        element = torch.empty((), dtype=self.dtype).element_size()
        return (2 * self.block_size * arch.num_key_value_heads * arch.head_dim * element
                * arch.num_hidden_layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Zeroed, so that padding slots read by a gather are finite and masked out cleanly."""
        arch = self.arch
        shape = (2, num_blocks, self.block_size, arch.num_key_value_heads, arch.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(arch.num_hidden_layers)]

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

    def prepare_inputs(self, step: SchedulerOutput) -> StepInputs:
        token_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        logits_indices: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for item in step.scheduled:
            request, start, count = item.request, item.start, item.num_tokens
            token_ids.extend(request.all_token_ids[start:start + count])
            pos = np.arange(start, start + count, dtype=np.int64)
            blocks = np.asarray(request.block_ids, dtype=np.int64)[pos // self.block_size]
            positions.append(pos)
            slots.append(blocks * self.block_size + pos % self.block_size)
            query_lens.append(count)
            seq_lens.append(start + count)
            if item.samples:
                logits_indices.extend([len(token_ids) - 1] * item.num_samples)
        device = self.device
        slot_mapping = torch.from_numpy(np.concatenate(slots)).to(device)
        metadata = build_attention_metadata(query_lens, seq_lens,
                                            [s.request.block_ids for s in step.scheduled],
                                            slot_mapping, self.block_size, device)
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
            positions=torch.from_numpy(np.concatenate(positions)).to(device),
            metadata=metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device))

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        inputs = self.prepare_inputs(step)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
        output = ModelRunnerOutput()
        if inputs.logits_indices.numel() == 0:
            return output
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        rows, owners = self._sampling_rows(step)
        metadata = build_sampling_metadata(rows, logits.shape[-1], self.device)
        sampled = self.sampler(logits, metadata, self.generator)
        for request_id, token_id, logprob in zip(owners, sampled.token_ids, sampled.logprobs):
            output.sampled.setdefault(request_id, []).append(token_id)
            output.logprobs.setdefault(request_id, []).append(logprob)
        return output

    @staticmethod
    def _sampling_rows(step: SchedulerOutput) -> tuple[list[SamplingRow], list[str]]:
        rows: list[SamplingRow] = []
        owners: list[str] = []
        for item in step.scheduled:
            if not item.samples:
                continue
            request = item.request
            for stream in range(item.num_samples):
                rows.append(SamplingRow(
                    params=request.sampling_params, prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids, eos_token_id=request.eos_token_id,
                    seed_stream=request.index + stream))
                owners.append(request.request_id)
        return rows, owners
