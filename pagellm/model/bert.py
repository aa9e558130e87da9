"""BERT-family encoders (`BertModel`: all-MiniLM, bge, e5...) for the pooling runner.

Parameter names are Hugging Face's (`embeddings.word_embeddings.weight`,
`encoder.layer.N.attention.self.query.weight`...), so a checkpoint's tensors load as
they are, with or without the `bert.` prefix. The forward takes a padded batch and its
attention mask: an encoder attends both ways over the whole input at once, so there is
no KV cache and nothing to page.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_IGNORED = ("pooler.", "embeddings.position_ids", "cls.")
_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "relu": F.relu}


@dataclass
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "BertConfig":
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported for BERT, got "
                             f"{config['position_embedding_type']!r}.")
        if config.get("hidden_act", "gelu") not in _ACTIVATIONS:
            raise ValueError(f"BERT activation {config['hidden_act']!r} is not supported.")
        names = [f for f in cls.__dataclass_fields__ if f in config]
        return cls(**{name: config[name] for name in names})


class _SelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, width = hidden.shape

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, length, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.query(hidden)), heads(self.key(hidden)),
                                             heads(self.value(hidden)), attn_mask=mask)
        return out.transpose(1, 2).reshape(batch, length, width)


class _DenseNorm(nn.Module):
    """A projection, dropout-free, added to the residual and layer-normed (BERT's `output`)."""

    def __init__(self, inputs: int, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(inputs, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.add_module("self", _SelfAttention(config))  # HF's name for it
        self.output = _DenseNorm(config.hidden_size, config)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(getattr(self, "self")(hidden, mask), hidden)


class _Intermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class _Layer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = _Attention(config)
        self.intermediate = _Intermediate(config)
        self.output = _DenseNorm(config.intermediate_size, config)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        attended = self.attention(hidden, mask)
        return self.output(self.intermediate(attended), attended)


class _Encoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))


class _Embeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        embedded = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
                    + self.token_type_embeddings.weight[0])  # one segment: type id 0
        return self.LayerNorm(embedded)


class BertModel(nn.Module):
    """`[B, L]` token ids and a `[B, L]` mask (True: a real token) -> `[B, L, hidden]`."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        mask = attention_mask[:, None, None, :]  # every query sees the real keys
        for layer in self.encoder.layer:
            hidden = layer(hidden, mask)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; every parameter must be set, no unknown one given."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if name.startswith(_IGNORED):
                continue
            if name not in params:
                raise ValueError(f"Unexpected weight {name!r} for a BERT model.")
            if params[name].shape != tensor.shape:
                raise ValueError(f"Weight {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(params[name].shape)}.")
            params[name].data.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"Checkpoint is missing {len(missing)} weight(s), e.g. "
                             f"{missing[:5]}.")

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


def read_bert_config(folder: Path) -> BertConfig:
    return BertConfig.from_hf(json.loads((folder / "config.json").read_text()))
