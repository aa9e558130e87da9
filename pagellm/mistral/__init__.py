"""Mistral's native release format: `params.json`, `consolidated.safetensors` with Mistral's
tensor names, and a `mistral-common` tokenizer (`tekken.json` or `tokenizer.model.v*`).

vLLM's `--config-format`, `--load-format` and `--tokenizer-mode mistral` select it
(formats.py); the folder's architecture becomes the Llama family's ArchConfig (params.py),
its weights are renamed and their rotary rows reordered onto the same model (weights.py),
and the tokenizer is an adapter with the HF tokenizer's interface (tokenizer.py).
"""
