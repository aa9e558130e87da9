"""Q5_0 and Q5_1 GGUF matrices kept as stored (8-bit codes with per-32 scales and zeros),
and GGUF files pagellm cannot read failing at start with one line that names the cause."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from test_models import PagedCache
from tiny_models import write_tiny_gguf

from pagellm.kernels import cpu_kernels_available
from pagellm.model.arch import arch_from_gguf
from pagellm.model.errors import ModelLoadError
from pagellm.model.gguf_weights import gguf_quantized_weights, gguf_weights
from pagellm.model.loader import load_model
from pagellm.model.quantized import Linear

CPU = torch.device("cpu")
Q5_0, Q5_1 = gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q5_1


@pytest.mark.parametrize("quantization", [Q5_0, Q5_1], ids=["Q5_0", "Q5_1"])
def test_q5_groups_are_the_dequantized_weights(tiny_model_factory: Callable[[str], Path],
                                               tmp_path: Path,
                                               quantization: gguf.GGMLQuantizationType) -> None:
    path = write_tiny_gguf(tiny_model_factory("llama"), tmp_path / "tiny.gguf", quantization)
    reader = gguf.GGUFReader(path)
    arch = arch_from_gguf(reader)
    dense = dict(gguf_weights(reader, arch))
    grouped = dict(gguf_quantized_weights(reader, arch))
    assert len(grouped) == 7 * arch.num_hidden_layers
    for name, weight in grouped.items():  # exactly gguf-py's dequantization, q/k unpermuted
        assert weight.bits == 8 and weight.codes.dtype == torch.int8
        assert (weight.zeros is None) == (quantization == Q5_0)
        torch.testing.assert_close(weight.dequantize(), dense[name], atol=1e-6, rtol=0)


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler")
@pytest.mark.parametrize("quantization", [Q5_0, Q5_1], ids=["Q5_0", "Q5_1"])
def test_q5_model_multiplies_its_codes_batch_invariantly(tiny_model_factory: Callable[[str], Path],
                                                         tmp_path: Path,
                                                         quantization: gguf.GGMLQuantizationType
                                                         ) -> None:
    """Every projection keeps only its codes (the engine's default GGUF load) and computes
    the dequantized model's logits."""
    folder = tiny_model_factory("llama")
    path = str(write_tiny_gguf(folder, tmp_path / "tiny.gguf", quantization))
    dense = load_model(path, torch.float32, CPU, tokenizer=str(folder))
    stored = load_model(path, torch.float32, CPU, tokenizer=str(folder),
                        gguf_quantized_max_tokens=None, batch_invariant=True)
    layers = [m for m in stored.model.modules() if isinstance(m, Linear) and m.quantized_max_tokens]
    assert len(layers) == 4 * stored.arch.num_hidden_layers
    assert all(layer.weight.numel() == 0 for layer in layers)  # no float copy kept
    prompts = [list(range(3, 30)), list(range(50, 58))]
    logits = [PagedCache(m.arch).step(m.model, list(enumerate(prompts))) for m in (dense, stored)]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


def _write_gguf(path: Path, arch: str, tensor: np.ndarray,
                kind: gguf.GGMLQuantizationType | None = None) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", tensor, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unreadable_tensor_type_is_one_line_naming_it(tmp_path: Path) -> None:
    iq4_nl_block = np.zeros((64, 18), dtype=np.uint8)  # 32 weights a block: llama.cpp's IQ4_NL
    path = _write_gguf(tmp_path / "iq4.gguf", "llama", iq4_nl_block,
                       gguf.GGMLQuantizationType.IQ4_NL)
    with pytest.raises(ModelLoadError) as error:
        load_model(str(path), torch.float32, CPU)
    message = str(error.value)
    assert "\n" not in message and message.startswith(str(path))
    assert "'blk.0.ffn_up.weight' has the GGUF type IQ4_NL" in message


@pytest.mark.parametrize("arch", ["phi2", "qwen2moe"])  # qwen2moe: experts and a shared one
def test_unsupported_architecture_is_one_line_naming_it(tmp_path: Path, arch: str) -> None:
    path = _write_gguf(tmp_path / f"{arch}.gguf", arch, np.zeros((64, 32), dtype=np.float32))
    with pytest.raises(ModelLoadError, match=f"Unsupported model_type '{arch}'") as error:
        load_model(str(path), torch.float32, CPU)
    assert "\n" not in str(error.value)
