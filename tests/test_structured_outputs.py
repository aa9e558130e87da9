"""Structured outputs below the API: spec validation, both grammar backends on a real
tokenizer, the token mask in the vectorized sampler, reasoning parsers."""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from pagellm.entrypoints.openai.reasoning import reasoning_parser
from pagellm.sample import Sampler, SamplingRow, build_sampling_metadata
from pagellm.sampling_params import SamplingParams
from pagellm.structured_outputs.backend import backend_class, choose_backend
from pagellm.structured_outputs.manager import RequestGrammar, fill_bitmasks
from pagellm.structured_outputs.params import StructuredOutputsConfig, StructuredOutputsParams

CPU = torch.device("cpu")


class AllowEven:
    """A stand-in grammar: only even token ids."""

    active = True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0x55555555


def test_mask_applies_to_constrained_rows_only_for_every_sampling_mode() -> None:
    vocab = 70
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0)) * 4
    modes = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.9, seed=7),
             dict(temperature=1.0, top_p=0.8, top_k=5, presence_penalty=1.0)]
    for mode in modes:
        rows = [SamplingRow(SamplingParams(**mode), [], [3, 4], None, grammar=g)
                for g in (AllowEven(), None, AllowEven(), None, AllowEven(), None)]
        free_rows = [SamplingRow(SamplingParams(**mode), [], [3, 4], None) for _ in range(6)]
        for seed in range(5):
            tokens = Sampler()(logits, build_sampling_metadata(rows, vocab, CPU),
                               torch.Generator().manual_seed(seed)).token_ids
            free = Sampler()(logits, build_sampling_metadata(free_rows, vocab, CPU),
                             torch.Generator().manual_seed(seed)).token_ids
            assert all(t % 2 == 0 for t in tokens[::2]), (mode, tokens)
            if mode.get("seed") is not None or mode["temperature"] == 0.0:
                assert tokens[1::2] == free[1::2]  # unconstrained rows are untouched
    assert build_sampling_metadata(free_rows, vocab, CPU).token_mask is None


@pytest.mark.parametrize("spec,needle", [
    ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "strin"),
    ({"regex": "a(b"}, "regex"), ({"grammar": 'root ::= ("a" | '}, "grammar"),
    ({"choice": []}, "choice"), ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "a", "json_object": True}, "exactly one"),
])
def test_invalid_specs_name_the_problem(spec: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        choose_backend(StructuredOutputsParams(**spec), StructuredOutputsConfig())


def test_config_is_vllm_json() -> None:
    config = StructuredOutputsConfig.parse('{"backend": "guidance", "max_whitespace": 2}')
    assert config.backend == "guidance" and config.max_whitespace == 2
    for text, needle in (('{"backend": "outlines"}', "backend"), ('{"colour": 1}', "unknown"),
                         ('{"disable_additional_properties": true}', "guidance")):
        with pytest.raises(ValueError, match=needle):
            StructuredOutputsConfig.parse(text)


def _walk(backend, params: StructuredOutputsParams, tokenizer, text: str) -> bool:
    """Feed `text`'s tokens through a matcher, each one checked against the mask first."""
    matcher = backend.compile(params).matcher()
    bitmask = torch.zeros(1, -(-backend.vocab_size // 32), dtype=torch.int32)
    for token in tokenizer.encode(text, add_special_tokens=False):
        matcher.fill_bitmask(bitmask, 0)
        if not (int(bitmask[0, token // 32]) >> (token % 32)) & 1:
            return False
        assert matcher.accept(token)
    return True


@pytest.mark.parametrize("name", ["xgrammar", "guidance"])
def test_backends_follow_the_spec_on_a_real_tokenizer(name: str, tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    vocab = len(tokenizer)
    config = StructuredOutputsConfig(backend=name, max_whitespace=2)
    backend = backend_class(name)(tokenizer, vocab, [tokenizer.eos_token_id], config)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    as_json = StructuredOutputsParams(json=schema)
    compact = json.dumps({"n": 12}, separators=(",", ":"))
    assert _walk(backend, as_json, tokenizer, compact if name == "guidance" else '{"n": 12}')
    assert not _walk(backend, as_json, tokenizer, '{"m": 1}')
    assert not _walk(backend, as_json, tokenizer, '{"n":' + " " * 6 + "1}")  # whitespace bound
    assert _walk(backend, StructuredOutputsParams(choice=["yes", "no"]), tokenizer, "no")
    assert not _walk(backend, StructuredOutputsParams(choice=["yes", "no"]), tokenizer, "maybe")
    assert _walk(backend, StructuredOutputsParams(regex="[0-9]{3}"), tokenizer, "123")


def _grammar_at(compiled, tokens: list[int]) -> RequestGrammar:
    done: Future = Future()
    done.set_result(compiled)
    grammar = RequestGrammar(done, deadline=float("inf"))
    assert grammar.ready
    for token in tokens:
        grammar.accept(token)
    return grammar


def test_one_call_fills_every_row_as_each_matcher_alone(tiny_llama_dir: Path) -> None:
    """The step's bitmask (xgrammar's rows in one native call, llguidance's and a stand-in's
    row by row) equals each matcher's own fill, at different points of the grammar."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    vocab = len(tokenizer)
    params = StructuredOutputsParams(json={"type": "object", "properties": {
        "name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name", "n"]})
    answer = tokenizer.encode('{"name": "Ada", "n": 12}', add_special_tokens=False)
    grammars: list = []
    for name in ("xgrammar", "guidance", "xgrammar"):
        config = StructuredOutputsConfig(backend=name)
        compiled = backend_class(name)(tokenizer, vocab, [tokenizer.eos_token_id],
                                       config).compile(params)
        grammars += [_grammar_at(compiled, answer[:k]) for k in (0, 2, 5, len(answer) - 1)]
    grammars.insert(3, AllowEven())
    width = -(-vocab // 32)
    bitmask = torch.full((len(grammars), width), -1, dtype=torch.int32)
    fill_bitmasks(grammars, bitmask)
    for row, grammar in enumerate(grammars):
        alone = torch.full((1, width), -1, dtype=torch.int32)
        grammar.fill_bitmask(alone, 0)
        assert torch.equal(bitmask[row], alone[0]), row
    assert len({tuple(row.tolist()) for row in bitmask}) > 3  # the points differ


@pytest.mark.parametrize("name,text,reasoning,content", [
    ("qwen3", "<think>Let me see.</think>\n\nIt is 4.", "Let me see.", "It is 4."),
    ("qwen3", "It is 4.", "", "It is 4."),
    ("qwen3", "<think>Still thinking", "Still thinking", ""),
    ("deepseek_r1", "Hmm, 2+2.</think>4", "Hmm, 2+2.", "4"),
    ("deepseek_r1", "<think>Hmm.</think>4", "Hmm.", "4"),
])
def test_reasoning_parsers_at_every_chunking(name: str, text: str, reasoning: str,
                                             content: str) -> None:
    parser = reasoning_parser(name)()
    assert parser.split(text, final=True) == (reasoning, content)
    for size in range(1, len(text) + 1):
        sent_reasoning = sent_content = ""
        for end in range(size, len(text) + size, size):
            got_reasoning, got_content = parser.split(text[:end], final=end >= len(text))
            assert got_reasoning.startswith(sent_reasoning)
            assert got_content.startswith(sent_content)
            sent_reasoning, sent_content = got_reasoning, got_content
        assert (sent_reasoning, sent_content) == (reasoning, content)
