"""Tiny Mistral checkpoints in Mistral's native layout, from the same random weights as an HF
folder, and a small Tekken tokenizer cut from one that mistral-common ships.

The native folder is written the way Mistral publishes models (params.json,
consolidated.safetensors, tekken.json): HF names mapped back to Mistral's and the q/k rows put
back in the interleaved rotary layout, the inverse of what pagellm does at load.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import mistral_common
import torch
import transformers
from mistral_common.tokens.tokenizers.base import SpecialTokens
from safetensors.torch import load_file, save_file

from pagellm.mistral.weights import _LAYER, _TOP_LEVEL, to_interleaved
from pagellm.model.arch import hf_rope

SHIPPED_TEKKEN = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"
NUM_SPECIAL = 100
NUM_ORDINARY = 412
TEKKEN_VOCAB = NUM_SPECIAL + NUM_ORDINARY  # 512


def write_small_tekken(path: Path, version: str = "v13") -> Path:
    """A valid Tekken file of 512 tokens: mistral-common's control tokens, then the first
    merge ranks of the shipped Tekken vocabulary (every single byte and the commonest
    merges), so BPE over it is well defined."""
    shipped = json.loads(SHIPPED_TEKKEN.read_text())
    specials = [{"rank": i, "token_str": token.value, "is_control": True}
                for i, token in enumerate(SpecialTokens)]
    vocab = shipped["vocab"][:NUM_ORDINARY]
    if any(len(base64.b64decode(entry["token_bytes"])) != 1 for entry in vocab[:256]):
        raise RuntimeError("the shipped Tekken file no longer starts with its 256 bytes")
    config = {**shipped["config"], "num_vocab_tokens": NUM_ORDINARY,
              "default_vocab_size": TEKKEN_VOCAB, "default_num_special_tokens": NUM_SPECIAL,
              "version": version}
    path.write_text(json.dumps({"config": config, "vocab": vocab, "special_tokens": specials}))
    return path


def build_tiny_hf_mistral(folder: Path, seed: int = 0, tied: bool = False) -> Path:
    """An HF `mistral` folder whose vocabulary is the small Tekken file's, with that file."""
    config = transformers.MistralConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        vocab_size=TEKKEN_VOCAB, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
        rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=tied,
        initializer_range=0.2)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return save_with_tekken(model, folder)


def write_native(hf_folder: Path, folder: Path) -> Path:
    """The HF folder in Mistral's layout: params.json, consolidated.safetensors, tekken.json."""
    config = json.loads((hf_folder / "config.json").read_text())
    folder.mkdir(parents=True, exist_ok=True)
    params = {"dim": config["hidden_size"], "n_layers": config["num_hidden_layers"],
              "head_dim": config["head_dim"], "hidden_dim": config["intermediate_size"],
              "n_heads": config["num_attention_heads"],
              "n_kv_heads": config["num_key_value_heads"], "norm_eps": config["rms_norm_eps"],
              "vocab_size": config["vocab_size"], "rope_theta": hf_rope(config)[0],
              "max_position_embeddings": config["max_position_embeddings"],
              "tied_embeddings": config["tie_word_embeddings"]}
    (folder / "params.json").write_text(json.dumps(params, indent=2))
    names = {hf: mistral for mistral, hf in _TOP_LEVEL.items()}
    for layer in range(config["num_hidden_layers"]):
        names.update({f"model.layers.{layer}.{hf}": f"layers.{layer}.{mistral}"
                      for mistral, hf in _LAYER.items()})
    tensors = {}
    for name, tensor in load_file(hf_folder / "model.safetensors").items():
        if ".q_proj." in name:
            tensor = to_interleaved(tensor, config["num_attention_heads"])
        elif ".k_proj." in name:
            tensor = to_interleaved(tensor, config["num_key_value_heads"])
        tensors[names[name]] = tensor.contiguous()
    save_file(tensors, folder / "consolidated.safetensors")
    (folder / "tekken.json").write_bytes((hf_folder / "tekken.json").read_bytes())
    return folder


# Ministral 3's long-context settings at a tiny scale: test prompts of 20-90 tokens cross the
# original 16 positions several times, so both YaRN and the query scale change the logits.
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                   "original_max_position_embeddings": 16, "beta_fast": 8.0, "beta_slow": 1.0,
                   "mscale": 0.0, "mscale_all_dim": 0.0, "llama_4_scaling_beta": 0.5}


def build_tiny_hf_ministral3(folder: Path, seed: int = 0,
                             rope: dict | None = None) -> Path:
    """An HF `ministral3` folder (YaRN with its attention factor, llama_4_scaling_beta), the
    small Tekken file's vocabulary, with that file."""
    config = transformers.Ministral3Config(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        vocab_size=TEKKEN_VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=11,
        rms_norm_eps=1e-5, rope_parameters=dict(rope or MINISTRAL3_ROPE),
        tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(seed)
    return save_with_tekken(transformers.Ministral3ForCausalLM(config).to(torch.float32), folder)


def save_with_tekken(model: torch.nn.Module, folder: Path) -> Path:
    """The random model, its norms drawn around 1 (not left at 1), saved as an HF folder with
    the small Tekken tokenizer."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
    model.save_pretrained(folder)
    write_small_tekken(folder / "tekken.json")
    return folder


def write_native_ministral3(hf_folder: Path, folder: Path) -> Path:
    """The Ministral 3 folder in Mistral's layout, with a vision encoder in params.json and a
    couple of its tensors in consolidated.safetensors (as Ministral 3's own release)."""
    write_native(hf_folder, folder)
    rope = json.loads((hf_folder / "config.json").read_text())["rope_parameters"]
    params = json.loads((folder / "params.json").read_text())
    params["yarn"] = {"factor": rope["factor"], "beta": rope["beta_fast"],
                      "alpha": rope["beta_slow"], "apply_scale": rope["mscale"] == 0,
                      "original_max_position_embeddings":
                          rope["original_max_position_embeddings"]}
    params["llama_4_scaling"] = {"beta": rope["llama_4_scaling_beta"],
                                 "original_max_position_embeddings":
                                     rope["original_max_position_embeddings"]}
    params["vision_encoder"] = {"hidden_size": 8, "num_hidden_layers": 1, "patch_size": 4,
                                "image_token_id": 10}
    (folder / "params.json").write_text(json.dumps(params, indent=2))
    tensors = load_file(folder / "consolidated.safetensors")
    tensors["vision_encoder.transformer.layers.0.attention.wq.weight"] = torch.randn(8, 8)
    tensors["vision_language_adapter.w_in.weight"] = torch.randn(64, 8)
    save_file(tensors, folder / "consolidated.safetensors")
    return folder


def write_hf_mistral3(hf_folder: Path, folder: Path) -> Path:
    """The same language model inside an HF `mistral3` (Mistral3ForConditionalGeneration)
    folder with a tiny Pixtral vision tower, and the Tekken file."""
    text = transformers.Ministral3ForCausalLM.from_pretrained(hf_folder, dtype=torch.float32)
    vision = transformers.PixtralVisionConfig(hidden_size=16, intermediate_size=32,
                                              num_hidden_layers=1, num_attention_heads=2,
                                              image_size=32, patch_size=16)
    config = transformers.Mistral3Config(vision_config=vision, text_config=text.config,
                                         spatial_merge_size=1, tie_word_embeddings=False)
    model = transformers.Mistral3ForConditionalGeneration(config).to(torch.float32)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.save_pretrained(folder)
    (folder / "tekken.json").write_bytes((hf_folder / "tekken.json").read_bytes())
    return folder
