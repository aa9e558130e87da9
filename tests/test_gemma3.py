"""Gemma 3 against Hugging Face transformers: a tiny random model, as an HF folder and as a
GGUF file, with prompts longer than its sliding window."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
import torch.nn.functional as F
from test_models import PROMPTS, PagedCache, assert_matches_transformers, reference_last_logits
from tiny_models import write_tiny_gguf
from transformers import AutoModelForCausalLM

from pagellm.kernels import cpu_kernels_available, gelu_tanh_and_mul
from pagellm.model.gemma3 import FULL, SLIDING
from pagellm.model.loader import load_model
from pagellm.model.text import GEMMA3_CHAT_TEMPLATE
from pagellm.tokenizer import apply_chat_template

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tiny_model_factory: Callable[[str], Path]) -> Path:
    return tiny_model_factory("gemma3_text")


def test_arch_reads_the_layer_pattern_windows_and_scales(tiny_gemma3_dir: Path) -> None:
    arch = load_model(str(tiny_gemma3_dir), torch.float32, CPU).arch
    assert arch.layer_types == [SLIDING] * 5 + [FULL]
    assert (arch.sliding_window, arch.query_pre_attn_scalar, arch.final_logit_softcapping,
            arch.local_rope_theta, arch.rope_theta) == (8, 24.0, 5.0, 10000.0, 1000000.0)
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_prefill_and_decode_past_the_window_match_transformers(tiny_gemma3_dir: Path) -> None:
    loaded = assert_matches_transformers(tiny_gemma3_dir)
    longest = max(len(loaded.tokenizer.encode(text)) for text in PROMPTS)
    assert longest > 3 * (loaded.arch.sliding_window or 0)


def test_chunked_prefill_across_the_window_matches_transformers(tiny_gemma3_dir: Path) -> None:
    loaded = load_model(str(tiny_gemma3_dir), torch.float32, CPU)
    ref = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32).eval()
    long = loaded.tokenizer.encode(PROMPTS[2])
    cache = PagedCache(loaded.arch)
    for end in (5, 13, 14, len(long)):  # chunks ending inside, at and past the first window
        start = cache.lengths.get(0, 0)
        last = cache.step(loaded.model, [(0, long[start:end])])[0]
        torch.testing.assert_close(last, reference_last_logits(ref, long[:end]), atol=1e-4,
                                   rtol=1e-4)


def test_gguf_conversion_matches_transformers(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    """llama.cpp's layout: its names for the four norms, stored as 1 + w."""
    path = write_tiny_gguf(tiny_gemma3_dir, tmp_path / "tiny-gemma3.gguf")
    loaded = load_model(str(path), torch.float32, CPU, tokenizer=str(tiny_gemma3_dir))
    assert loaded.arch.layer_types == [SLIDING] * 5 + [FULL]
    ref = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32).eval()
    for layer in ref.model.layers:  # GGUF has no query_pre_attn_scalar: llama.cpp's head_dim
        layer.self_attn.scaling = loaded.arch.head_dim ** -0.5
    assert loaded.arch.final_logit_softcapping == ref.config.final_logit_softcapping
    prompts = [loaded.tokenizer.encode(text) for text in PROMPTS]
    logits = PagedCache(loaded.arch).step(loaded.model, list(enumerate(prompts)))
    for row, ids in zip(logits, prompts):
        torch.testing.assert_close(row, reference_last_logits(ref, ids), atol=1e-4, rtol=1e-4)


def test_builtin_chat_template(tiny_gemma3_dir: Path) -> None:
    """Gemma's turns, for files that carry no template (the real GGUF's test loads it)."""
    tokenizer = load_model(str(tiny_gemma3_dir), torch.float32, CPU).tokenizer
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"}]
    text = tokenizer.decode(apply_chat_template(tokenizer, messages, GEMMA3_CHAT_TEMPLATE))
    assert text.endswith("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                         "<start_of_turn>model\nHello<end_of_turn>\n"
                         "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gelu_tanh_kernel_matches_torch(dtype: torch.dtype) -> None:
    """GeGLU's fused activation, extremes included, against torch's tanh GELU times up, each
    rounded to the dtype where torch rounds."""
    gate = torch.cat([torch.randn(4, 60) * 3, torch.tensor([[-1e4, -30.0, -3.0, -1e-4]] * 4)], 1)
    up = torch.randn_like(gate)
    gate_up = torch.cat([gate, up], dim=1).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.gelu(gate, approximate="tanh") * up
    tolerance = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2,
                                                                             "rtol": 1e-2}
    torch.testing.assert_close(gelu_tanh_and_mul(gate_up), expected, **tolerance)


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler")
def test_quantized_gguf_from_prepared_weights_is_the_same_model(tiny_gemma3_dir: Path,
                                                                tmp_path: Path) -> None:
    """The engine's GGUF load (codes kept, batch-invariant) of a Q8_0 Gemma 3: the dequantized
    model's logits, then bit-identical ones from the prepared weights it cached (whose norms
    must not gain a second `+ 1`)."""
    path = str(write_tiny_gguf(tiny_gemma3_dir, tmp_path / "tiny-gemma3-q8.gguf",
                               gguf.GGMLQuantizationType.Q8_0))
    dense = load_model(path, torch.float32, CPU, tokenizer=str(tiny_gemma3_dir))
    prompts = [list(range(3, 40)), list(range(50, 58))]
    expected = PagedCache(dense.arch).step(dense.model, list(enumerate(prompts)))
    results = []
    for _ in range(2):  # prepared from the file, then read from the cache
        stored = load_model(path, torch.float32, CPU, tokenizer=str(tiny_gemma3_dir),
                            gguf_quantized_max_tokens=None, batch_invariant=True)
        assert stored.model.model.layers[0].self_attn.qkv_proj.quantized is not None
        results.append(PagedCache(stored.arch).step(stored.model, list(enumerate(prompts))))
    torch.testing.assert_close(results[0], expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(results[1], results[0])
