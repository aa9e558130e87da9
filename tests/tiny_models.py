"""Tiny random-weight HF model folders, built offline in about a second each.

Each folder holds config.json, safetensors weights, generation_config.json and a
byte-level BPE tokenizer trained in-process, with a ChatML chat template whose
end-of-turn token `<|im_end|>` is the EOS. The four types cover every switch
of the model class: llama (Llama 3 RoPE scaling, BOS added by the tokenizer),
mistral (plain), qwen2 (q/k/v bias, tied embeddings, sharded weights) and
qwen3 (q/k norm, all attention biases, head_dim != hidden / heads).
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

TINY_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS, EOS = "<|endoftext|>", "<|im_end|>"
BOS_ID, EOS_ID = SPECIAL_TOKENS.index(BOS), SPECIAL_TOKENS.index(EOS)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog while the sun sets behind the hills.
A language model reads a sequence of tokens and predicts the next one, again and again.
Serving many requests at once means keeping the keys and values of every sequence in memory.
Blocks of a fixed size let the cache grow without copying, much like pages of virtual memory.
Once upon a time there was a small village by the river, where people baked bread every morning.
The children walked to school, the farmers went to the fields, and the baker sold warm loaves.
Numbers such as 1, 2, 3, 42, 100 and 2024 appear in text, along with dates and prices like $5.99.
Questions: what is the capital of France? Paris is, and Berlin is the capital of Germany.
Scientists measure temperature, pressure and speed; engineers build bridges, engines and computers.
Hello! How are you today? I am fine, thank you. Please tell me a story about a brave little robot.
The robot wanted to learn how to paint, so it watched the painters and practiced every single night.
Every good test is fast, deterministic and clear about what it checks, and it fails for one reason.
Greedy decoding always picks the most likely token; sampling draws from the whole distribution.
Attention compares each query with all previous keys, and rotary embeddings encode the positions.
"""

_SHARED: dict[str, Any] = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                           "num_attention_heads": 4, "num_key_value_heads": 2,
                           "max_position_embeddings": 1024, "vocab_size": VOCAB_SIZE,
                           "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "rms_norm_eps": 1e-5,
                           "initializer_range": 0.2}
_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"rope_theta": 50000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "mistral": ("MistralConfig", {"sliding_window": None, "head_dim": 16}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True, "rope_theta": 1000000.0}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "attention_bias": True}),
    # four experts, two a token: Mixtral renormalizes their weights; this Qwen3-MoE does not
    # and keeps a dense MLP in its second layer
    "mixtral": ("MixtralConfig", {"head_dim": 16, "num_local_experts": 4,
                                  "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 96, "norm_topk_prob": False,
                                     "mlp_only_layers": [1]}),
    # a shared expert beside the routed ones; decoder_sparse_step 2 leaves layer 0 dense
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 96,
                                     "shared_expert_intermediate_size": 160,
                                     "decoder_sparse_step": 2}),
    # the Qwen3-MoE llama.cpp converts: every layer routed, the chosen weights renormalized
    "qwen3_moe_gguf": ("Qwen3MoeConfig", {"head_dim": 32, "num_experts": 4,
                                          "num_experts_per_tok": 2, "moe_intermediate_size": 96,
                                          "norm_topk_prob": True}),
    # six layers: five sliding-window ones (a window of 8, shorter than the prompts) and a
    # global one with linear RoPE scaling; a softcap and an attention scale not 1/sqrt(d)
    "gemma3_text": ("Gemma3TextConfig", {
        "num_hidden_layers": 6, "head_dim": 16, "sliding_window": 8,
        "query_pre_attn_scalar": 24, "final_logit_softcapping": 5.0,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                               "rope_theta": 1000000.0},
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": 10000.0}}}),
}
# A shard limit below the model size makes save_pretrained write an index.
_SHARD_SIZES = {"qwen2": "200KB"}


@functools.cache
def _trained_tokenizer_json() -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"Tiny tokenizer has {tokenizer.get_vocab_size()} tokens, "
                           f"expected {VOCAB_SIZE}; lengthen the corpus.")
    return tokenizer.to_str()


def build_tiny_tokenizer(add_bos: bool) -> PreTrainedTokenizerFast:
    """The shared byte-level BPE; with `add_bos`, encoding prepends BOS like Llama's."""
    tokenizer = Tokenizer.from_str(_trained_tokenizer_json())
    template = CHAT_TEMPLATE
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)])
        template = "{{ bos_token }}" + CHAT_TEMPLATE
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS,
                                   pad_token=BOS, chat_template=template)


def build_tiny_model(folder: Path, model_type: str, seed: int = 0, **sizes: Any) -> Path:
    """Write a tiny random `model_type` checkpoint with its tokenizer into `folder`; `sizes`
    override the config's (K-quants need matrices 256 inputs wide)."""
    config_class, overrides = _VARIANTS[model_type]
    config = getattr(transformers, config_class)(**{**_SHARED, **overrides, **sizes})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_norms_and_biases(model)
    model.generation_config.eos_token_id = [EOS_ID, BOS_ID]
    model.save_pretrained(folder, max_shard_size=_SHARD_SIZES.get(model_type, "50GB"))
    build_tiny_tokenizer(add_bos=model_type == "llama").save_pretrained(folder)
    return folder


@torch.no_grad()
def _randomize_norms_and_biases(model: torch.nn.Module) -> None:
    """HF initializes norms to one and biases to zero; random values test their loading."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.normal_(1.0, 0.2)
        elif name.endswith(".bias"):
            param.normal_(0.0, 0.2)


def write_tiny_gguf(folder: Path, path: Path,
                    quantization: gguf.GGMLQuantizationType | None = None,
                    embedding_quantization: gguf.GGMLQuantizationType | None = None) -> Path:
    """Convert a tiny HF folder to a GGUF laid out as llama.cpp's converter does.

    Names come from gguf-py's own tensor map; Llama-type q/k rows get llama.cpp's
    permutation, Llama 3 RoPE scaling becomes a `rope_freqs` tensor and each layer's experts
    are stacked into one `ffn_*_exps` tensor per projection. Tensors are F32, except the
    layers' projection matrices (experts included, routers not, as llama.cpp's quantizer
    does) with a `quantization` (e.g. Q4_1) and the embeddings and output projection with
    an `embedding_quantization` (e.g. Q8_0).
    """
    config = json.loads((folder / "config.json").read_text())
    arch = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen3_moe": "qwen3moe",
            "gemma3_text": "gemma3"}.get(config["model_type"], config["model_type"])
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' (the GGUF's)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    _add_experts(writer, config)
    for name, values in _gguf_tensors(folder, config, arch):
        matrix = values.ndim >= 2 and ".ffn_gate_inp." not in name
        kind = (quantization if name.startswith("blk.") and matrix else
                embedding_quantization if name in ("token_embd.weight", "output.weight") else None)
        if kind is not None:
            writer.add_tensor(name, _quantized(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, values)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(head_dim, rope))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_experts(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """llama.cpp's expert keys: Mixtral's experts have `intermediate_size`, Qwen3-MoE's
    `moe_intermediate_size` (its dense layers `intermediate_size`)."""
    experts = config.get("num_local_experts", config.get("num_experts"))
    if not experts:
        return
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if "moe_intermediate_size" in config:
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])


def _stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`...experts.E.w1.weight` for every E -> one `...experts.w1.weight` [experts, out, in],
    the name gguf-py's map knows."""
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, tensor in tensors.items():
        match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(.*)", name)
        if match:
            stacked.setdefault(f"{match[1]}.{match[3]}", {})[int(match[2])] = tensor
        else:
            out[name] = tensor
    for name, experts in stacked.items():
        out[name] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def _quantized(values: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """gguf-py's quantizer, or for Q6_K (which it lacks) quantize_q6_k."""
    if kind == gguf.GGMLQuantizationType.Q6_K:
        return quantize_q6_k(values)
    return gguf.quants.quantize(values, kind)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """Rows of Q6_K blocks (210 bytes per 256 weights) for float rows: a simple round to
    nearest, not llama.cpp's search; tests compare with gguf-py's dequantization of it."""
    rows, cols = values.shape
    groups = values.reshape(-1, 16, 16)  # [blocks, 16 groups of 16]
    largest = np.abs(groups).max(-1)
    d = (largest.max(-1) / (127 * 31)).astype(np.float16)
    sc = np.round(largest / np.maximum(d.astype(np.float32)[:, None] * 31, 1e-30))
    sc = np.clip(sc, -128, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None, None] * sc[..., None]
    q = np.round(np.divide(groups, step, out=np.zeros_like(groups), where=step != 0))
    return pack_q6_k((np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 256), sc, d,
                     rows)


def pack_q6_k(codes: np.ndarray, sc: np.ndarray, d: np.ndarray, rows: int) -> np.ndarray:
    """Q6_K blocks from codes 0..63 [blocks, 256], int8 scales [blocks, 16] and fp16 d
    [blocks]: per half of 128, 64 bytes of low nibbles (weights l and 64 + l in byte l),
    then 32 bytes of high bit pairs (weight 32j + l in bits 2j of byte l), after both halves
    the scales, then d."""
    halves = codes.reshape(-1, 2, 128)
    low = (halves[..., :64] & 15) | ((halves[..., 64:] & 15) << 4)
    high = sum(((halves[..., 32 * j:32 * j + 32] >> 4) << (2 * j)) for j in range(4))
    blocks = np.concatenate([low.reshape(-1, 128), high.astype(np.uint8).reshape(-1, 64),
                             sc.view(np.uint8), d.reshape(-1, 1).view(np.uint8)], axis=1)
    return blocks.reshape(rows, -1)


def _gguf_tensors(folder: Path, config: dict[str, Any],
                  arch: str) -> list[tuple[str, np.ndarray]]:
    model_arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    name_map = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    tensors = _stacked_experts(tensors)
    out = []
    for name, tensor in tensors.items():
        values = tensor.numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
            values = values.reshape(heads, 2, -1, *values.shape[1:]).swapaxes(1, 2)
            values = values.reshape(tensor.shape)
        if arch == "gemma3" and name.endswith("norm.weight"):  # llama.cpp stores 1 + w
            values = values + 1.0
        out.append((name_map.get_name(name, try_suffixes=(".weight", ".bias")), values))
    return out


def _llama3_rope_factors(head_dim: int, rope: dict[str, Any]) -> np.ndarray:
    """llama.cpp's per-frequency divisors for Llama 3 scaling."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)
