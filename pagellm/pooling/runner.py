"""Token ids of a batch in, one vector per input out: the pooling counterpart of
`pagellm.worker.model_runner`.

An encoder runs a padded `[B, L]` batch with its mask. A decoder converted to an
embedding model runs the same forward as for generation, over a scratch KV cache
sized to this batch and freed after it: nothing is kept between steps, so the engine
allocates no KV cache for it either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.model.attention import build_attention_metadata, kv_cache_shape
from pagellm.model.bert import BertModel
from pagellm.pooling.config import PoolerConfig

_SCRATCH_BLOCK = 16


def pool(hidden: torch.Tensor, lengths: list[int], config: PoolerConfig) -> torch.Tensor:
    """`[B, L, H]` hidden states of inputs of `lengths` tokens (left-aligned) -> `[B, H]`."""
    hidden = hidden.float()
    if config.pooling_type == "CLS":
        pooled = hidden[:, 0]
    elif config.pooling_type == "LAST":
        last = torch.tensor([n - 1 for n in lengths], device=hidden.device)
        pooled = hidden[torch.arange(len(lengths), device=hidden.device), last]
    else:
        mask = (torch.arange(hidden.shape[1], device=hidden.device)[None, :]
                < torch.tensor(lengths, device=hidden.device)[:, None])
        summed = (hidden * mask[..., None]).sum(dim=1)
        pooled = summed / mask.sum(dim=1, keepdim=True).clamp(min=1)
    return F.normalize(pooled, dim=-1) if config.normalize else pooled


class EncoderRunner:
    def __init__(self, model: BertModel, config: PoolerConfig, device: torch.device,
                 pad_token_id: int) -> None:
        self.model, self.config, self.device = model, config, device
        self.pad_token_id = pad_token_id

    @torch.inference_mode()
    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        lengths = [len(ids) for ids in batch]
        width = max(lengths)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        for row, tokens in enumerate(batch):
            ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
        hidden = self.model(ids.to(self.device), mask.to(self.device))
        return pool(hidden, lengths, self.config).cpu()


class DecoderRunner:
    """A causal LM's final hidden states, pooled; attention over a batch-sized scratch cache."""

    def __init__(self, model: torch.nn.Module, arch, config: PoolerConfig,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.arch, self.config = model, arch, config
        self.device, self.dtype = device, dtype

    @torch.inference_mode()
    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        lengths = [len(ids) for ids in batch]
        tables, slots, first = [], [], 0
        for length in lengths:
            count = -(-length // _SCRATCH_BLOCK)
            tables.append(list(range(first, first + count)))
            slots.extend(first * _SCRATCH_BLOCK + offset for offset in range(length))
            first += count
        arch = self.arch
        shape = kv_cache_shape(first, _SCRATCH_BLOCK, arch.num_key_value_heads, arch.head_dim)
        caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                  for _ in range(arch.num_hidden_layers)]
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=self.device)
        metadata = build_attention_metadata(lengths, lengths, tables, slot_mapping,
                                            _SCRATCH_BLOCK, self.device)
        ids = torch.tensor([t for tokens in batch for t in tokens], device=self.device)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(self.device)
        flat = self.model(ids, positions, caches, metadata)
        padded = torch.zeros(len(batch), max(lengths), flat.shape[-1], dtype=flat.dtype,
                             device=flat.device)
        start = 0
        for row, length in enumerate(lengths):
            padded[row, :length] = flat[start:start + length]
            start += length
        return pool(padded, lengths, self.config).cpu()
