"""A mistral-common tokenizer behind the interface the engine uses for HF tokenizers.

`--tokenizer-mode mistral` loads `tekken.json` (Tekken, tiktoken-based) or
`tokenizer.model.v*` (SentencePiece) with mistral-common, and conversations are encoded by
its own `ChatCompletionRequest` encoder (tools, tool calls and tool results in Mistral's
format) instead of a Jinja template. Decoding keeps control tokens such as `[TOOL_CALLS]`
as text when `skip_special_tokens` is off, so a tool-call parser sees its marker.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from itertools import groupby
from pathlib import Path
from typing import Any

from mistral_common.exceptions import MistralCommonException
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.validator import ValidationMode
from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from mistral_common.tokens.tokenizers.tekken import Tekkenizer
from pydantic import ValidationError

# the chat message keys mistral-common reads; others (reasoning_content) are not part of
# Mistral's prompt format, as an HF template ignores keys it does not use
_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")
_CALL_ID = re.compile(r"[a-zA-Z0-9]{9}")
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class MistralCommonTokenizer:
    """encode/decode/vocabulary as PreTrainedTokenizerFast offers them, plus
    `render_chat`, which pagellm.tokenizer.apply_chat_template hands conversations to."""

    chat_template = None

    def __init__(self, file: Path) -> None:
        self.file = Path(file)
        self.mistral = MistralTokenizer.from_file(str(self.file), mode=ValidationMode.test)
        self.raw = self.mistral.instruct_tokenizer.tokenizer
        self.version = self.raw.version.value
        self.is_tekken = isinstance(self.raw, Tekkenizer)
        self.special_ids = frozenset(int(i) for i in self.raw.special_ids)
        self._vocab: dict[str, int] | None = None

    def __getstate__(self) -> dict[str, Any]:  # the file reloads faster than tiktoken pickles
        return {"file": self.file}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["file"])

    def __len__(self) -> int:
        return self.raw.n_words

    @property
    def bos_token_id(self) -> int:
        return self.raw.bos_id

    @property
    def eos_token_id(self) -> int:
        return self.raw.eos_id

    @property
    def pad_token_id(self) -> int | None:
        return self.raw.pad_id if self.raw.pad_id >= 0 else None

    @property
    def unk_token_id(self) -> int:
        return self.raw.unk_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As mistral-common encodes a prompt: BOS first with special tokens, no EOS."""
        return self.raw.encode(text, bos=add_special_tokens, eos=False)

    def __call__(self, texts: list[str], add_special_tokens: bool = True,
                 truncation: bool = False, max_length: int | None = None
                 ) -> dict[str, list[list[int]]]:
        """Batch encoding as an HF tokenizer returns it (the embedding routes'); truncation
        keeps the first `max_length` tokens, BOS included."""
        ids = [self.encode(text, add_special_tokens) for text in texts]
        if truncation and max_length is not None:
            ids = [row[:max_length] for row in ids]
        return {"input_ids": ids}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Runs of ordinary tokens decoded by the tokenizer; control tokens as their text
        (`[TOOL_CALLS]`) unless skipped."""
        parts = []
        for special, run in groupby((int(i) for i in ids), lambda i: i in self.special_ids):
            run = list(run)
            if not special:
                parts.append(self.raw.decode(run, special_token_policy=SpecialTokenPolicy.IGNORE))
            elif not skip_special_tokens:
                parts.extend(self.raw.id_to_piece(i) for i in run)
        return "".join(parts)

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.get_vocab().get(token, self.unk_token_id)

    def get_vocab(self) -> dict[str, int]:
        if self._vocab is None:
            self._vocab = {piece: i for i, piece in enumerate(self.raw.vocab())}
        return self._vocab

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes as generated text, for grammars; control tokens are none (a
        grammar never writes them as text; the stop tokens end it)."""
        return [b"" if i in self.special_ids else
                self._ordinary_bytes(i) for i in range(len(self))]

    def _ordinary_bytes(self, token_id: int) -> bytes:
        if self.is_tekken:
            return self.raw.id_to_byte_piece(token_id, SpecialTokenPolicy.KEEP)
        piece = self.raw.id_to_piece(token_id)
        byte = _BYTE_PIECE.fullmatch(piece)
        return bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode()

    def render_chat(self, messages: list[dict[str, Any]], chat_template: str | None,
                    add_generation_prompt: bool, **template_kwargs: Any) -> list[int]:
        """mistral-common's encoding of the conversation and its tools; what it cannot honour
        (a Jinja template and its arguments, no generation prompt) is refused by name."""
        if chat_template is not None:
            raise ValueError("chat_template is not supported with --tokenizer-mode mistral: "
                             "mistral-common encodes conversations in Mistral's own format.")
        tools = template_kwargs.pop("tools", None)
        if template_kwargs:
            raise ValueError(f"chat_template_kwargs {sorted(template_kwargs)} are not supported "
                             "with --tokenizer-mode mistral.")
        if not add_generation_prompt:
            raise ValueError("add_generation_prompt=false is not supported with "
                             "--tokenizer-mode mistral: its prompts always end in [/INST].")
        try:
            request = ChatCompletionRequest.model_validate(
                {"messages": [_mistral_message(message) for message in messages],
                 **({"tools": tools} if tools else {})})
            return list(self.mistral.encode_chat_completion(request).tokens)
        except (MistralCommonException, ValidationError) as error:
            raise ValueError(f"mistral-common cannot encode these messages: {error}") from None


def _mistral_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI message as mistral-common validates it: tool call ids of 9 letters and
    digits (an id of another form maps to one, the same in the call and its result)."""
    out = {key: message[key] for key in _MESSAGE_KEYS if message.get(key) is not None}
    if "tool_calls" in out:
        out["tool_calls"] = [{**call, "id": mistral_call_id(call.get("id"))}
                             for call in out["tool_calls"]]
        if not out.get("content"):
            out.pop("content", None)
    if "tool_call_id" in out:
        out["tool_call_id"] = mistral_call_id(out["tool_call_id"])
    return out


def mistral_call_id(call_id: str | None) -> str:
    if call_id is None or _CALL_ID.fullmatch(call_id):
        return call_id or "000000000"
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]
