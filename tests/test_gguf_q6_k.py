"""Q6_K and Q8_K GGUF matrices kept as stored: Q6_K as signed 8-bit codes with a scale per
16 weights, Q8_K as 8-bit codes with a scale per 32, multiplied by the same kernels as the
other quantized types."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from test_models import PagedCache, greedy_decode, reference_greedy, transformers_gguf_model
from test_quantized import random_weight
from tiny_models import build_tiny_model, pack_q6_k, write_tiny_gguf
from transformers import AutoConfig

from pagellm.kernels import cpu_kernels_available
from pagellm.model.arch import ArchConfig, arch_from_hf_config
from pagellm.model.gguf_weights import gguf_quantized_weights, gguf_weights
from pagellm.model.loader import LoadedModel, load_model
from pagellm.model.quantized import ANY_TOKENS, GroupQuantWeight, Linear

CPU = torch.device("cpu")
Q6_K, Q8_K = gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.Q8_K
needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler")
ROWS, COLS = 40, 512


def random_q6_k_blocks(rows: int, cols: int) -> np.ndarray:
    """Every code 0..63 and int8 scale, extremes included, with a small fp16 d per block."""
    rng = np.random.default_rng(rows + cols)
    blocks = rows * cols // 256
    codes = rng.integers(0, 64, size=(blocks, 256), dtype=np.uint8)
    codes[0, :2] = 0, 63
    sc = rng.integers(-128, 128, size=(blocks, 16)).astype(np.int8)
    sc[0, :2] = -128, 127
    d = rng.uniform(1e-4, 2e-3, size=blocks).astype(np.float16)
    return pack_q6_k(codes, sc, d, rows)


def random_q8_k_blocks(rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Q8_K blocks (float32 d, 256 int8 codes, 16 int16 sums of 16) and their weights."""
    rng = np.random.default_rng(rows * cols)
    d = rng.uniform(1e-4, 1e-2, size=(rows * cols // 256, 1)).astype(np.float32)
    codes = rng.integers(-128, 128, size=(len(d), 256)).astype(np.int8)
    sums = codes.reshape(-1, 16, 16).astype(np.int16).sum(-1, dtype=np.int16)
    blocks = np.concatenate([d.view(np.uint8), codes.view(np.uint8), sums.view(np.uint8)], axis=1)
    return blocks.reshape(rows, -1), (d * codes).reshape(rows, cols)


def _read_one(path: Path, arch: ArchConfig) -> tuple[GroupQuantWeight, torch.Tensor]:
    """The file's one matrix as codes, and as the float loading path reads it."""
    reader = gguf.GGUFReader(path)
    [(name, weight)] = gguf_quantized_weights(reader, arch)
    [(dense_name, dense)] = gguf_weights(reader, arch)
    assert name == dense_name == "model.layers.0.mlp.down_proj.weight"
    return weight, dense


def _write_one(path: Path, blocks: np.ndarray, kind: gguf.GGMLQuantizationType) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.ffn_down.weight", blocks, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def llama_arch(tiny_model_factory: Callable[[str], Path]) -> ArchConfig:
    config = (tiny_model_factory("llama") / "config.json").read_text()
    return arch_from_hf_config(json.loads(config))


def test_q6_k_codes_are_gguf_py_dequantization_bit_for_bit(tmp_path: Path,
                                                           llama_arch: ArchConfig) -> None:
    path = _write_one(tmp_path / "q6_k.gguf", random_q6_k_blocks(ROWS, COLS), Q6_K)
    weight, dense = _read_one(path, llama_arch)
    assert weight.bits == 8 and weight.codes.dtype == torch.int8 and weight.zeros is None
    assert weight.group_size == 16 and weight.scales.shape == (ROWS, COLS // 16)
    assert int(weight.codes.min()) == -32 and int(weight.codes.max()) == 31
    reference = gguf.quants.dequantize(gguf.GGUFReader(path).tensors[0].data, Q6_K)
    assert torch.equal(weight.dequantize(), torch.from_numpy(reference.reshape(ROWS, COLS)))
    assert torch.equal(dense, weight.dequantize())


def test_q8_k_codes_are_its_scaled_bytes(tmp_path: Path, llama_arch: ArchConfig) -> None:
    """gguf-py has no Q8_K dequantizer: the reference is d * code, and the float loading
    path reads the same weights."""
    blocks, expected = random_q8_k_blocks(ROWS, COLS)
    weight, dense = _read_one(_write_one(tmp_path / "q8_k.gguf", blocks, Q8_K), llama_arch)
    assert weight.bits == 8 and weight.group_size == 32 and weight.zeros is None
    assert torch.equal(weight.dequantize(), torch.from_numpy(expected))
    assert torch.equal(dense, torch.from_numpy(expected))


@needs_kernels
@pytest.mark.parametrize("int8_activations", [False, True], ids=["float32", "int8"])
def test_q6_k_layer_multiplies_like_its_dequantized_weight(tmp_path: Path, llama_arch: ArchConfig,
                                                           int8_activations: bool) -> None:
    """Few rows (passes over the codes) and many (panels), as a batch-invariant layer does."""
    path = _write_one(tmp_path / "q6_k.gguf", random_q6_k_blocks(ROWS, COLS), Q6_K)
    weight, dense = _read_one(path, llama_arch)
    layer = Linear(COLS, ROWS, bias=False)
    layer.attach_quantized(weight, max_tokens=ANY_TOKENS)
    x = torch.randn(30, COLS)
    for rows in (1, 5, 30):
        torch.testing.assert_close(layer(x[:rows]), x[:rows] @ dense.T, atol=1e-4, rtol=1e-5)
    invariant = Linear(COLS, ROWS, bias=False)
    invariant.attach_batch_invariant(weight, int8_activations)
    alone = torch.cat([invariant(x[i:i + 1]) for i in range(len(x))])
    assert torch.equal(invariant(x), alone)  # a row's result is the same in any batch


def test_mixed_group_sizes_fuse_in_groups_of_16() -> None:
    """Q4_K q and k with a Q6_K v: one projection, each part its own weights."""
    parts = [random_weight(4, 32, 256, True), random_weight(8, 16, 256, True),
             random_weight(8, 16, 256, False, group_size=16)]
    fused = GroupQuantWeight.cat(parts)
    assert fused.bits == 8 and fused.group_size == 16
    # the 4-bit codes' offset folds into their zeros (as fusing Q4_K with Q5_K does): one
    # float32 rounding apart; the Q6_K rows exactly
    torch.testing.assert_close(fused.dequantize(), torch.cat([p.dequantize() for p in parts]),
                               atol=1e-6, rtol=0)
    assert torch.equal(fused.dequantize()[48:], parts[2].dequantize())


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def q6_k_model(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny model 256 wide (K-quants' blocks are 256 weights) whose projections are all
    Q6_K: a Llama with a Q8_0 output head, or a Qwen2 whose tied embeddings are Q6_K too
    (looked up as float rows, multiplied as codes). Its folder and its GGUF."""
    folder = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}-256"),
                              request.param, hidden_size=256, intermediate_size=512)
    head = gguf.GGMLQuantizationType.Q8_0 if request.param == "llama" else Q6_K
    return folder, write_tiny_gguf(folder, folder / "q6_k.gguf", Q6_K, head)


def _last_logits(loaded: LoadedModel, prompts: list[list[int]]) -> torch.Tensor:
    return PagedCache(loaded.arch).step(loaded.model, list(enumerate(prompts)))


PROMPTS = [list(range(3, 40)), list(range(100, 109)), [7]]


@needs_kernels
def test_q6_k_model_is_the_dequantized_model(q6_k_model: tuple[Path, Path]) -> None:
    """The engine's GGUF load in float32 without int8 activations: only the codes are kept,
    and the logits and greedy tokens are the dequantized model's, which are transformers'
    load of the same file."""
    folder, path = q6_k_model
    dense = load_model(str(path), torch.float32, CPU, tokenizer=str(folder))
    stored = load_model(str(path), torch.float32, CPU, tokenizer=str(folder),
                        gguf_quantized_max_tokens=None, batch_invariant=True)
    layers = [m for m in stored.model.modules() if isinstance(m, Linear) and m.quantized_max_tokens
              and m is not stored.model.lm_head]
    assert len(layers) == 4 * stored.arch.num_hidden_layers  # qkv, o, gate_up, down
    assert all(layer.weight.numel() == 0 and layer.quantized.group_size == 16 for layer in layers)
    head = stored.model.lm_head.quantized
    assert head.group_size == (16 if stored.arch.tie_word_embeddings else 32)
    expected = _last_logits(dense, PROMPTS)
    torch.testing.assert_close(_last_logits(stored, PROMPTS), expected, atol=1e-4, rtol=1e-4)
    ref, _ = transformers_gguf_model(path, stored.arch, AutoConfig.from_pretrained(folder))
    cache = PagedCache(stored.arch)
    tokens = greedy_decode(cache, stored.model, cache.step(stored.model, list(enumerate(PROMPTS))),
                           12)
    for ours, prompt in zip(tokens, PROMPTS):
        theirs = reference_greedy(ref, prompt, 12)
        assert ours[:len(theirs)] == theirs


@needs_kernels
def test_q6_k_model_with_int8_activations_is_batch_invariant(q6_k_model: tuple[Path, Path]) -> None:
    """The engine's default GGUF load: int8 panels, and each prompt's logits the same alone
    as together (their numerics: test_quantized's int8 kernel test, Q6_K case)."""
    folder, path = q6_k_model
    stored = load_model(str(path), torch.float32, CPU, tokenizer=str(folder),
                        gguf_quantized_max_tokens=None, gguf_int8_activations=True,
                        batch_invariant=True)
    assert all(m.int8_panels is not None and m.quantized is None for m in stored.model.modules()
               if isinstance(m, Linear) and m.quantized_max_tokens)
    together = _last_logits(stored, PROMPTS)
    for row, prompt in zip(together, PROMPTS):
        assert torch.equal(_last_logits(stored, [prompt])[0], row)
