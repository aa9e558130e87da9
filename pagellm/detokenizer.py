"""Incremental detokenization with stop strings, one instance per sequence.

Text is produced by decoding two small token windows, ids[prefix:read] and
ids[prefix:], and emitting the difference once it no longer ends in an
incomplete UTF-8 character. The window starts a few tokens back so that
context-dependent decoding (a sentencepiece '▁' or byte-level 'Ġ' leading
space, multi-byte characters split over tokens) comes out as full decoding
would; cost per token is independent of the output length.

Decoding goes through the fast tokenizer's own decoder, exactly as
`PreTrainedTokenizerFast.decode(..., clean_up_tokenization_spaces=False)`;
as in transformers and vLLM's fast path, `spaces_between_special_tokens`
has no effect on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagellm.sampling_params import SamplingParams

# Prompt tokens kept as decoding context for the first output tokens.
_PROMPT_CONTEXT_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def _backend(tokenizer: object) -> _Decoder:
    """The `tokenizers.Tokenizer` behind a fast tokenizer (or the Tokenizer itself)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not callable(getattr(backend, "decode", None)):
        raise TypeError(f"{type(tokenizer).__name__} is not a fast (tokenizers-backed) tokenizer.")
    return backend


class IncrementalDetokenizer:
    def __init__(self, tokenizer: object, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        self._decoder = _backend(tokenizer)
        self._skip_special = params.skip_special_tokens
        self._stops: list[str] = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        longest_stop = max((len(s) for s in self._stops), default=0)
        self._hold_back = 0 if self._include_stop else max(longest_stop - 1, 0)
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None
        self._num_output_tokens = 0
        self._text = ""
        self._sent = 0

    @property
    def output_text(self) -> str:
        return self._text

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append tokens; return the stop string that ended the text, if any.

        `stop_terminated` says the last token is an EOS / stop token id that
        ends the sequence: it is then not rendered (unless
        include_stop_str_in_output) and stop strings are not searched.
        """
        if stop_terminated and not self._include_stop:
            new_token_ids = new_token_ids[:-1]
        search_from = len(self._text)
        for token_id in new_token_ids:
            self._ids.append(token_id)
            self._num_output_tokens += 1
            self._text += self._decode_next()
            if self._num_output_tokens <= self._min_tokens:
                search_from = len(self._text)
        if stop_terminated:
            return None
        return self._check_stop(search_from)

    def get_text(self, final: bool) -> str:
        """All text that may be shown: everything when final, else minus the held-back tail."""
        hold = 0 if final else self._hold_back
        return self._text[:max(len(self._text) - hold, 0)]

    def get_delta(self, final: bool) -> str:
        """Text not returned before; holds back a possible partial stop string until final."""
        visible = self.get_text(final)
        if len(visible) <= self._sent:
            return ""
        delta = visible[self._sent:]
        self._sent = len(visible)
        return delta

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._decoder.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def _decode_next(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(self._prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        return delta

    def _check_stop(self, search_from: int) -> str | None:
        """Find the earliest stop string ending in the new text and truncate there."""
        if not self._stops or search_from >= len(self._text):
            return None
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self._text.find(stop, max(search_from - len(stop) + 1, 0))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self._text = self._text[:index + len(stop) if self._include_stop else index]
        return stop
