"""A rank's part of the decoder, with the communication put where Megatron puts it.

`ParallelCausalLM` wraps one rank's `LlamaForCausalLM` (built by ShardLayout) and keeps the
interface the model runner calls: `forward` and `compute_logits`. Inside:
- tensor parallel: one all-reduce after each row-parallel projection (o_proj, down_proj), the
  vocabulary-parallel embedding's all-reduce, and the logits gathered to the stage's tp rank 0;
- pipeline parallel: the first stage looks tokens up, each stage runs its layers and sends the
  hidden states and residual on, the last normalizes and computes the logits, which go to
  rank 0, where the sampler runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagellm.distributed.group import ParallelGroup
from pagellm.distributed.sharding import ShardLayout
from pagellm.model.attention import AttentionMetadata
from pagellm.model.llama import LlamaForCausalLM

# each message between two ranks has its own tag, so none is ever taken for another
_HIDDEN_TAG, _RESIDUAL_TAG, _LOGITS_TAG = 0, 1, 2


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + rows) of the padded vocabulary; other ids look up zeros, and the
    all-reduce over the tensor parallel group sums each token's one non-zero row."""

    def __init__(self, rows: int, hidden_size: int, start: int) -> None:
        super().__init__(rows, hidden_size, _weight=torch.empty(rows, hidden_size),
                         _freeze=True)
        self.start = start
        self.group: ParallelGroup | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.group is not None
        if self.group.info.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(hidden)


class ParallelCausalLM(nn.Module):
    def __init__(self, net: LlamaForCausalLM, layout: ShardLayout, group: ParallelGroup) -> None:
        super().__init__()
        self.net, self.layout, self.group = net, layout, group
        self.vocab_size = layout.arch.vocab_size
        # the last step's hidden states and residual, with their sends to the next stage
        self._sends: list[tuple[torch.Tensor, dist.Work]] = []
        embedding = net.model.embed_tokens
        assert isinstance(embedding, VocabParallelEmbedding)
        embedding.group = group
        if group.info.tp_size > 1:
            for layer in net.model.layers:
                layer.self_attn.o_proj.register_forward_hook(self._reduce)
                layer.mlp.down_proj.register_forward_hook(self._reduce)

    def _reduce(self, _module: nn.Module, _inputs: object, output: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(output.contiguous())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Like LlamaForCausalLM.forward. Off the last stage, the result only stands for the
        output rows' shape: the logits come from the last stage."""
        info, inner = self.group.info, self.net.model
        if info.is_first_stage:
            hidden, residual = inner.embed_tokens(input_ids), None
        else:
            shape = (input_ids.shape[0], self.layout.arch.hidden_size)
            hidden = self.group.recv_previous(self._empty(shape), tag=_HIDDEN_TAG)
            residual = self.group.recv_previous(self._empty(shape), tag=_RESIDUAL_TAG)
        rows = output_rows if info.is_last_stage else None
        hidden, residual = inner.run_layers(hidden, residual, positions, kv_caches, metadata,
                                            rows)
        if info.is_last_stage:
            return inner.norm(hidden, residual)[0]
        assert residual is not None
        self._send_next(hidden.contiguous(), residual.contiguous())
        return hidden if output_rows is None else hidden[output_rows]

    def _send_next(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Send without waiting, so that under the engine core's batch queue rank 0 goes on
        to the next step while the next stage computes this one; the previous step's sends
        are waited for first (they are done by then, or close), so at most one step's are in
        the air and each tag has one message outstanding."""
        for _, work in self._sends:
            work.wait()
        self._sends = [(hidden, self.group.send_next(hidden, tag=_HIDDEN_TAG)),
                       (residual, self.group.send_next(residual, tag=_RESIDUAL_TAG))]

    def _empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        weight = self.net.model.norm.weight
        return torch.empty(shape, dtype=weight.dtype, device=weight.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The full vocabulary's logits on rank 0; None on every other rank. Rank 0 receives
        them when it asks (under the batch queue: when it waits for the step's result)."""
        group = self.group
        info = group.info
        if info.is_last_stage:
            logits = group.gather_to_root(self.net.compute_logits(hidden))
            if logits is None:
                return None
            logits = logits[:, :self.vocab_size]
            if info.rank == 0:
                return logits
            dist.send(logits.float().contiguous(), 0, group=group.logits_group,
                      tag=_LOGITS_TAG)
            return None
        if info.rank != 0:
            return None
        logits = torch.empty((hidden.shape[0], self.vocab_size), dtype=torch.float32,
                             device=hidden.device)
        dist.recv(logits, group.last_root, group=group.logits_group, tag=_LOGITS_TAG)
        return logits.to(hidden.dtype)

    def weight_bytes(self) -> int:
        return self.net.weight_bytes()

    def num_weights(self) -> int:
        return self.net.num_weights()

    def weight_bytes_read(self, tokens: int) -> int:
        """This rank's share (see LlamaForCausalLM.weight_bytes_read)."""
        return self.net.weight_bytes_read(tokens)
