"""How far pagellm's int8 activations move the embedded model's logits, next to llama.cpp.

For a few prompts, the next-token logits of the same GGUF from: pagellm's exact dequantized
model (float32), pagellm with int8 activations (the default for prefills), and llama.cpp
(`llama-cpp-python`, a benchmark extra), which rounds activations to int8 for its
quantized matrices too. Prints the mean absolute difference of each pair and the argmax.

    python benchmarks/logits_vs_llamacpp.py
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import gguf
import numpy as np
import torch

from pagellm.model.gguf_weights import gguf_quantized_weights
from pagellm.model.loader import LoadedModel, load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_models import PagedCache  # noqa: E402

PROMPTS = ("The capital of France is Paris, and the capital of Germany is",
           "Once upon a time, in a small village, there lived an old man who",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "The quick brown fox jumps over the lazy dog. The quick brown fox")


def next_token_logits(loaded: LoadedModel, prompt: list[int]) -> torch.Tensor:
    cache = PagedCache(loaded.arch, num_blocks=64, block_size=16)
    return cache.step(loaded.model, [(0, prompt)])[0]


def main() -> None:
    from llama_cpp import Llama

    exact = load_model(None, torch.float32, torch.device("cpu"))
    int8 = copy.deepcopy(exact)
    int8.model.attach_quantized_weights(
        gguf_quantized_weights(gguf.GGUFReader(exact.path), exact.arch), 4096,
        int8_activations=True)
    llama = Llama(model_path=str(exact.path), n_ctx=256, n_threads=2, logits_all=True,
                  verbose=False)
    print("tokens | int8 vs exact | llama.cpp vs exact | llama.cpp vs int8 | argmax (exact, "
          "int8, llama.cpp)")
    for text in PROMPTS:
        prompt = exact.tokenizer.encode(text)
        reference, rounded = next_token_logits(exact, prompt), next_token_logits(int8, prompt)
        llama.reset()
        llama.eval(prompt)
        theirs = torch.from_numpy(np.array(llama.scores[len(prompt) - 1], dtype=np.float32))
        distance = lambda a, b: (a - b).abs().mean().item()  # noqa: E731
        print(f"{len(prompt)} | {distance(rounded, reference):.3f} | "
              f"{distance(theirs, reference):.3f} | {distance(theirs, rounded):.3f} | "
              f"{reference.argmax().item()}, {rounded.argmax().item()}, {theirs.argmax().item()}")


if __name__ == "__main__":
    main()
