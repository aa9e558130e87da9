"""Mistral's native format: params.json + consolidated.safetensors + tekken.json load into the
same model as their HF conversion (logits within 1e-5 in float32, greedy tokens identical, and
both equal to transformers on the HF folder), tokenized by mistral-common itself."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from tiny_mistral import build_tiny_hf_mistral, write_native, write_small_tekken
from transformers import AutoModelForCausalLM

from pagellm.detokenizer import IncrementalDetokenizer
from pagellm.entrypoints.openai.tool_parsers.json_calls import MistralToolParser
from pagellm.mistral.formats import ModelFormats
from pagellm.mistral.tokenizer import MistralCommonTokenizer
from pagellm.mistral.weights import to_half_split, to_interleaved
from pagellm.model.loader import load_model
from pagellm.sampling_params import SamplingParams
from pagellm.tokenizer import apply_chat_template
from test_models import PagedCache, greedy_decode, reference_greedy, reference_last_logits

CPU = torch.device("cpu")
TEXTS = ["Bonjour, peux-tu te présenter ?", "The capital of France is", "1, 2, 3, 4,"]
MISTRAL = ModelFormats("mistral", "mistral", "mistral")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mistral")
    hf = build_tiny_hf_mistral(root / "hf")
    return hf, write_native(hf, root / "native")


def test_rotary_reordering_inverts_and_swaps_pairs() -> None:
    weight = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3)
    half = to_half_split(weight, num_heads=2)
    assert torch.equal(to_interleaved(half, 2), weight)
    # head 0's rows (0, 1) are a rotary pair in Mistral's layout: rows 0 and 4 in HF's
    assert torch.equal(half[[0, 4]], weight[[0, 1]])
    assert torch.equal(half[[8, 12]], weight[[8, 9]])


@pytest.mark.parametrize("formats", [MISTRAL, ModelFormats()], ids=["flags", "auto"])
def test_native_folder_matches_hf_folder_and_transformers(folders: tuple[Path, Path],
                                                          formats: ModelFormats) -> None:
    hf, native = folders
    ours = load_model(str(native), torch.float32, CPU, formats=formats)
    converted = load_model(str(hf), torch.float32, CPU,
                           formats=ModelFormats(tokenizer_mode="mistral"))
    assert isinstance(ours.tokenizer, MistralCommonTokenizer)
    # params.json names no BOS/EOS ids (the tokenizer has them)
    assert ours.arch == replace(converted.arch, bos_token_id=None, eos_token_id=None)
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    prompts = [ours.tokenizer.encode(text) for text in TEXTS]
    caches = [PagedCache(loaded.arch, num_blocks=128, block_size=4) for loaded in (ours,
                                                                                    converted)]
    logits = [cache.step(loaded.model, list(enumerate(prompts)))
              for cache, loaded in zip(caches, (ours, converted))]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)
    for row, ids in zip(logits[0], prompts):
        torch.testing.assert_close(row, reference_last_logits(ref, ids), atol=1e-5, rtol=1e-5)
    tokens = [greedy_decode(cache, loaded.model, first, 8)
              for cache, loaded, first in zip(caches, (ours, converted), logits)]
    assert tokens[0] == tokens[1]
    for generated, ids in zip(tokens[0], prompts):
        expected = reference_greedy(ref, ids, 8)
        assert generated[:len(expected)] == expected


def test_hf_folder_with_params_json_reads_config_json_under_auto(folders: tuple[Path, Path],
                                                                 tmp_path: Path) -> None:
    """auto prefers the HF files where both are present (vLLM's order)."""
    hf, native = folders
    both = tmp_path / "both"
    both.mkdir()
    for file in [*hf.iterdir(), native / "params.json", native / "consolidated.safetensors"]:
        (both / file.name).symlink_to(file)
    assert ModelFormats().resolved(both) == ModelFormats("hf", "hf", "safetensors")
    assert ModelFormats().resolved(native) == MISTRAL


@pytest.mark.parametrize("file", ["small", "tekken_240911.json", "tokenizer.model.v1",
                                  "mistral_instruct_tokenizer_241114.model.v7"])
def test_tokenization_equals_mistral_common(file: str, tmp_path: Path) -> None:
    from tiny_mistral import SHIPPED_TEKKEN

    path = (write_small_tekken(tmp_path / "tekken.json") if file == "small" else
            SHIPPED_TEKKEN.parent / file)
    ours = MistralCommonTokenizer(path)
    theirs = MistralTokenizer.from_file(str(path)).instruct_tokenizer.tokenizer
    for text in [*TEXTS, "héhé 😄 naïve\n\tcode()"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, bos=True, eos=False)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, special_token_policy="ignore")


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Forecast", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("version", ["v3", "v7", "v13"])
def test_tool_call_round_trips_through_mistral_format(version: str, tmp_path: Path) -> None:
    """mistral-common writes an assistant's tool call; decoded with its control tokens kept,
    the mistral parser reads the same call back, and the call and its result encode."""
    tokenizer = MistralCommonTokenizer(write_small_tekken(tmp_path / "tekken.json", version))
    call = {"id": "chatcmpl-tool-0123", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Quel temps fait-il ?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "Soleil"}]
    ids = apply_chat_template(tokenizer, messages, None, tools=TOOLS)
    text = tokenizer.decode(ids)
    assert "[TOOL_CALLS]" in text and "Soleil" in text
    assert "[TOOL_CALLS]" not in tokenizer.decode(ids, skip_special_tokens=True)
    # the engine's streaming detokenizer, one token at a time, as a reply is generated
    start = ids.index(tokenizer.convert_tokens_to_ids("[TOOL_CALLS]"))
    end = ids.index(tokenizer.eos_token_id, start)
    detokenizer = IncrementalDetokenizer(tokenizer, ids[:start],
                                         SamplingParams(skip_special_tokens=False))
    for token_id in ids[start:end]:
        detokenizer.update([token_id])
    answer = detokenizer.get_text(final=True)
    assert answer == text[text.index("[TOOL_CALLS]"):text.index("</s>")]
    parsed = MistralToolParser().parse(answer, final=True).calls
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [("get_weather",
                                                                   {"city": "Paris"})]


def test_grammars_build_on_mistral_common_token_bytes(tmp_path: Path) -> None:
    """Both structured-output backends accept the tokenizer; a JSON grammar allows the
    token of "{" first and never a control token."""
    from pagellm.structured_outputs.guidance_backend import GuidanceBackend
    from pagellm.structured_outputs.params import (StructuredOutputsConfig,
                                                   StructuredOutputsParams)
    from pagellm.structured_outputs.xgrammar_backend import XGrammarBackend

    tokenizer = MistralCommonTokenizer(write_small_tekken(tmp_path / "tekken.json"))
    [brace] = tokenizer.encode("{", add_special_tokens=False)
    for backend in (XGrammarBackend, GuidanceBackend):
        grammar = backend(tokenizer, len(tokenizer), [tokenizer.eos_token_id],
                          StructuredOutputsConfig()).compile(
            StructuredOutputsParams(json={"type": "object"}))
        allowed = allowed_tokens(grammar, len(tokenizer))
        assert brace in allowed, backend.name
        assert not allowed & tokenizer.special_ids, backend.name


def test_fields_mistral_common_cannot_honour_are_refused(tmp_path: Path) -> None:
    tokenizer = MistralCommonTokenizer(write_small_tekken(tmp_path / "tekken.json"))
    messages = [{"role": "user", "content": "Bonjour"}]
    with pytest.raises(ValueError, match="chat_template is not supported"):
        apply_chat_template(tokenizer, messages, "{{ messages }}")
    with pytest.raises(ValueError, match=r"chat_template_kwargs \['enable_thinking'\]"):
        apply_chat_template(tokenizer, messages, None, enable_thinking=True)
    with pytest.raises(ValueError, match="add_generation_prompt=false"):
        apply_chat_template(tokenizer, messages, None, add_generation_prompt=False)


def allowed_tokens(grammar, vocab_size: int) -> set[int]:
    """The ids a fresh matcher of `grammar` allows first."""
    from pagellm.structured_outputs.backend import bitmask_width

    bitmask = torch.zeros(1, bitmask_width(vocab_size), dtype=torch.int32)
    grammar.matcher().fill_bitmask(bitmask, 0)
    words = bitmask[0].tolist()
    return {i for i in range(vocab_size) if (words[i // 32] >> (i % 32)) & 1}
