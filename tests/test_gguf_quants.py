"""GGUF matrices read into groups of codes exactly as stored (Q4_0, Q4_1, the K-quants, Q5_0
and Q5_1 as 8-bit codes with per-32 scales and zeros), and GGUF files pagellm cannot read
failing at start with one line that names the cause."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from test_models import PagedCache
from test_quantized import random_weight
from tiny_models import write_tiny_gguf

from pagellm.kernels import cpu_kernels_available
from pagellm.model.arch import arch_from_gguf, arch_from_hf_config
from pagellm.model.errors import ModelLoadError
from pagellm.model.gguf_file import GGUFFileReader, GGUFModelReader
from pagellm.model.gguf_weights import gguf_quantized_weights, gguf_weights, hf_name
from pagellm.model.loader import load_model
from pagellm.model.quantized import ANY_TOKENS, GroupQuantWeight, Linear

CPU = torch.device("cpu")
Q4_0, Q4_1, Q8_0 = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                    gguf.GGMLQuantizationType.Q8_0)
Q5_0, Q5_1 = gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q5_1
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def assert_same_fields(ours: gguf.GGUFReader, theirs: gguf.GGUFReader) -> None:
    """Every field's parts (the arrays transformers reads values from), in gguf's order and
    dtypes, its data indices, types and offset."""
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.data, mine.types) == (field.offset, field.data, field.types), name
        assert len(mine.parts) == len(field.parts), name
        for part, reference in zip(mine.parts, field.parts):
            assert part.dtype == reference.dtype and part.shape == reference.shape, name
            assert np.array_equal(part, reference), name
        assert mine.contents() == field.contents(), name


def test_the_file_reader_reads_what_gguf_reads(smollm2_gguf: Path) -> None:
    """Every metadata value (the tokenizer's arrays among them) and every tensor of the
    embedded GGUF, as gguf's own reader gives them."""
    ours, theirs = GGUFFileReader(smollm2_gguf), gguf.GGUFReader(smollm2_gguf)
    assert_same_fields(ours, theirs)
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type, list(mine.shape)) == (
            reference.name, reference.tensor_type, list(reference.shape))
        assert mine.data.dtype == reference.data.dtype
        assert np.array_equal(mine.data, reference.data)


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG],
                         ids=["little-endian", "big-endian"])
def test_the_file_reader_reads_every_kind_of_array(tmp_path: Path,
                                                   endianess: gguf.GGUFEndian) -> None:
    """Arrays the reader reads in one pass (strings, every scalar type) and those it leaves
    to gguf (arrays of arrays), in either byte order, as gguf reads them."""
    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(path, "llama", endianess=endianess)
    writer.add_array("strings", ["", "a", "ß€", "x" * 300])
    writer.add_array("one.string", ["only"])
    writer.add_array("nested", [[1, 2], [3]])
    scalars = [kind for kind in gguf.GGUFValueType
               if kind not in (gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY)]
    for kind in scalars:
        values = [True, False] if kind == gguf.GGUFValueType.BOOL else [0, 1, 2]
        writer.add_key_value(f"numbers.{kind.name}", values, gguf.GGUFValueType.ARRAY, kind)
    writer.add_string("after", "the arrays")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert_same_fields(GGUFFileReader(path), gguf.GGUFReader(path))


GGUF_IMPORT = """
import sys
if sys.argv[1] == "mistral_common first":
    import mistral_common.tokens.tokenizers.mistral
import pagellm.model.gguf_file
import gguf.vocab
assert (gguf.vocab.MistralTokenizer is not None) == (sys.argv[1] == "mistral_common first")
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
"""


@pytest.mark.parametrize("order", ["gguf first", "mistral_common first"])
def test_gguf_loads_without_mistral_common_which_still_imports_after(order: str) -> None:
    """gguf's vocab module imports mistral_common only for conversions pagellm never calls
    (0.3 s of a first start in two processes); a process that has it already keeps it."""
    subprocess.run([sys.executable, "-c", GGUF_IMPORT, order], check=True)


def test_the_model_reader_skips_only_the_long_arrays(smollm2_gguf: Path) -> None:
    """The engine's reader: the tokenizer's three long arrays typed but without values,
    every other metadata value and every tensor (data and place) as gguf reads them."""
    ours, theirs = GGUFModelReader(smollm2_gguf), gguf.GGUFReader(smollm2_gguf)
    assert list(ours.fields) == list(theirs.fields)
    skipped = [name for name, field in ours.fields.items() if not field.data]
    assert skipped == ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                       "tokenizer.ggml.merges"]
    for name, field in theirs.fields.items():
        assert ours.fields[name].types == field.types, name
        if name not in skipped:
            assert ours.fields[name].contents() == field.contents(), name
    assert [(t.name, t.data_offset, list(t.shape)) for t in ours.tensors] == [
        (t.name, t.data_offset, list(t.shape)) for t in theirs.tensors]
    assert all(np.array_equal(mine.data, reference.data)
               for mine, reference in zip(ours.tensors, theirs.tensors))


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


def test_q8_0_tensors_dequantize_to_gguf_s_values(tiny_model_factory: Callable[[str], Path],
                                                  tmp_path: Path) -> None:
    """Q8_0 embeddings and projections, which gguf_weights reads through their groups: the
    very floats gguf-py's dequantizer gives (q and k aside, whose rows it also reorders)."""
    path = write_tiny_gguf(tiny_model_factory("llama"), tmp_path / "tiny.gguf", Q8_0, Q8_0)
    reader = gguf.GGUFReader(path)
    dense = dict(gguf_weights(reader, arch_from_gguf(reader)))
    compared = 0
    for tensor in (t for t in reader.tensors if t.tensor_type == Q8_0):
        name = hf_name(tensor.name)
        if ".q_proj." in name or ".k_proj." in name:
            continue
        values = gguf.dequantize(tensor.data, Q8_0).reshape([int(d) for d in
                                                             reversed(tensor.shape)])
        assert torch.equal(dense[name], torch.from_numpy(values)), name
        compared += 1
    assert "model.embed_tokens.weight" in dense and compared >= 2 + 5 * 2  # 2 layers


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


def test_kernel_codes_pack_two_elements_per_byte_in_gguf_order() -> None:
    codes = torch.arange(64, dtype=torch.uint8).remainder(16).reshape(1, 64)
    weight = GroupQuantWeight(codes, torch.ones(1, 2), None, 4)
    packed = weight.kernel_codes()
    assert packed.shape == (1, 32)
    # element j of a group in the low nibble of byte j, element 16 + j in its high nibble
    assert packed[0, 0].item() == (codes[0, 0] | codes[0, 16] << 4).item()
    assert packed[0, 17].item() == (codes[0, 33] | codes[0, 49] << 4).item()


@pytest.mark.parametrize("quantization", [Q4_0, Q4_1], ids=["Q4_0", "Q4_1"])
def test_gguf_groups_are_the_dequantized_weights(tiny_model_factory: Callable[[str], Path],
                                                 tmp_path: Path,
                                                 quantization: gguf.GGMLQuantizationType) -> None:
    path = write_tiny_gguf(tiny_model_factory("llama"), tmp_path / "tiny.gguf", quantization,
                           embedding_quantization=Q8_0)
    reader = gguf.GGUFReader(path)
    arch = arch_from_gguf(reader)
    dense = dict(gguf_weights(reader, arch))
    grouped = dict(gguf_quantized_weights(reader, arch))
    projections = sorted(name for name in dense if name.split(".")[-2] in PROJECTIONS)
    assert len(projections) == len(PROJECTIONS) * arch.num_hidden_layers
    assert sorted(grouped) == sorted([*projections, "lm_head.weight", "model.embed_tokens.weight"])
    for name, weight in grouped.items():  # q/k rows unpermuted like the dense ones
        assert weight.bits == (8 if "lm_head" in name or "embed" in name else 4)
        torch.testing.assert_close(weight.dequantize(), dense[name], atol=1e-6, rtol=0)


def random_k_blocks(rows: int, cols: int, block_bytes: int) -> np.ndarray:
    """K-quant blocks of random bytes (Q4_K: 144 per 256 weights, Q5_K: 176) with small
    positive fp16 d and dmin: gguf-py has no K-quant quantizer, only the reference
    dequantizer."""
    rng = np.random.default_rng(rows + cols)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, block_bytes), dtype=np.uint8)
    for at in (0, 2):  # d, dmin
        halves = rng.uniform(1e-3, 2e-2, size=len(blocks)).astype(np.float16)
        blocks[:, at:at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler")
@pytest.mark.parametrize("quantization,block_bytes,bits",
                         [(gguf.GGMLQuantizationType.Q4_K, 144, 4),
                          (gguf.GGMLQuantizationType.Q5_K, 176, 8)], ids=["Q4_K", "Q5_K"])
def test_k_quant_groups_are_the_dequantized_weights(tiny_model_factory: Callable[[str], Path],
                                                    tmp_path: Path,
                                                    quantization: gguf.GGMLQuantizationType,
                                                    block_bytes: int, bits: int) -> None:
    rows, cols = 24, 512
    path = tmp_path / "k_quant.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.ffn_up.weight", random_k_blocks(rows, cols, block_bytes),
                      raw_dtype=quantization)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(path)
    config = json.loads((tiny_model_factory("llama") / "config.json").read_text())
    [(name, weight)] = gguf_quantized_weights(reader, arch_from_hf_config(config))
    assert name == "model.layers.0.mlp.up_proj.weight" and weight.bits == bits
    reference = gguf.quants.dequantize(reader.tensors[0].data, quantization)
    reference = torch.from_numpy(reference.reshape(rows, cols))
    torch.testing.assert_close(weight.dequantize(), reference, atol=1e-6, rtol=1e-6)
    layer = Linear(cols, rows, bias=False)
    layer.attach_quantized(weight, max_tokens=ANY_TOKENS)
    x = torch.randn(5, cols)
    torch.testing.assert_close(layer(x), x @ reference.T, atol=1e-4, rtol=1e-5)


def test_shards_of_mixed_widths_fuse_as_8_bit_codes() -> None:
    """A projection whose shards come as 4-bit and 8-bit codes (Q4_K q/k with a Q5_K v)
    keeps one quantized form: the 4-bit codes widened, the same weights."""
    parts = [random_weight(4, 64, 96, with_zeros=True), random_weight(4, 32, 96, False),
             random_weight(8, 32, 96, with_zeros=False)]
    fused = GroupQuantWeight.cat(parts)
    assert fused.bits == 8 and fused.codes.dtype == torch.int8
    torch.testing.assert_close(fused.dequantize(), torch.cat([p.dequantize() for p in parts]),
                               atol=1e-7, rtol=0)


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
