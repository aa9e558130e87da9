"""A model's text side: its tokenizer, chat template and EOS ids, loaded apart from its weights.

An API server loads its own while its engine core, forked at start, imports torch and loads
the weights on the other CPU core; the engine core loads them only if it needs them (a
request's grammar, a draft model's vocabulary check, the offline LLM). Loaded in the core
and sent over, they cost a restart a second on its critical path: transformers' import,
then the tokenizer. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagellm.mistral.formats import ModelFormats
from pagellm.model.errors import reading
from pagellm.model.paths import resolve_model_path
from pagellm.tokenizer import (eos_token_ids, find_chat_template, load_mistral_tokenizer,
                               load_tokenizer, tokenizer_source)

# The template Gemma 3's instruction-tuned releases carry, for files that do not (GGUF
# conversions often lack it): a system message is folded into the first user turn, the
# assistant's role is called "model", and each turn ends with <end_of_turn>.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set first = 0 %}{% set system = '' %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\n\\n' %}{% set first = 1 %}{% endif %}"
    "{% for message in messages[first:] %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{% if loop.first %}{{ system }}{% endif %}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
GEMMA3_END_OF_TURN = "<end_of_turn>"


@dataclass(frozen=True)
class TokenizerSpec:
    """Where a model's tokenizer comes from: its path, `--tokenizer`, and vLLM's tokenizer
    mode ("hf" or "mistral", as ModelFormats resolved it for the path)."""

    path: Path
    override: str | None = None
    mode: str = "hf"


@dataclass
class ModelText:
    tokenizer: Any
    chat_template: str | None
    eos_token_ids: list[int]


def load_text_tokenizer(spec: TokenizerSpec) -> Any:
    """The tokenizer alone: the part that takes time. A tokenizer that does not load is one
    line naming its file (ModelLoadError)."""
    source = tokenizer_source(spec.path, spec.override)
    if spec.mode == "mistral":
        return load_mistral_tokenizer(source)
    with reading(source, "the tokenizer does not load"):
        return load_tokenizer(spec.path, spec.override)


def model_text(tokenizer: Any, spec: TokenizerSpec, model_type: str) -> ModelText:
    """The chat template and EOS ids of a loaded tokenizer, for the family `model_type`."""
    if spec.mode == "mistral":  # mistral-common renders its own conversations
        return ModelText(tokenizer, None, [tokenizer.eos_token_id])
    source = tokenizer_source(spec.path, spec.override)
    with reading(source, "the tokenizer does not load"):
        chat_template = find_chat_template(source, tokenizer)
    eos_ids = eos_token_ids(spec.path, tokenizer)
    if model_type == "gemma3_text":  # a GGUF file may carry neither
        chat_template = chat_template or GEMMA3_CHAT_TEMPLATE
        end_of_turn = tokenizer.convert_tokens_to_ids(GEMMA3_END_OF_TURN)
        if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
            eos_ids = list(dict.fromkeys([*eos_ids, end_of_turn]))
    return ModelText(tokenizer, chat_template, eos_ids)


@dataclass(frozen=True)
class EarlyTokenizer:
    """A front end's tokenizer, loaded while its engine core loads the weights."""

    spec: TokenizerSpec
    tokenizer: Any


def load_early_tokenizer(model: str | None, override: str | None,
                         formats: ModelFormats) -> EarlyTokenizer | None:
    """The tokenizer, loaded while the engine core loads, in a thread of lower CPU priority
    (nice + 10, Linux's nice values being per thread): the core's work is the start's
    critical path, and on a first start the two compete for the cores (the kernels' compile
    there, the tokenizer's rebuild from a GGUF here, 4 s of CPU for SmolLM2's); the rebuild
    then takes the cycles the compile leaves. None where it does not load: the engine core
    then reports a bad model or tokenizer in its own words first, and `tokenizer_for` tries
    again with the core's spec."""
    with ThreadPoolExecutor(1, thread_name_prefix="pagellm-tokenizer",
                            initializer=_lower_this_threads_priority) as loader:
        return loader.submit(_early_tokenizer, model, override, formats).result()


def _early_tokenizer(model: str | None, override: str | None,
                     formats: ModelFormats) -> EarlyTokenizer | None:
    try:
        path = resolve_model_path(model)
        spec = TokenizerSpec(path, override, formats.resolved(path).tokenizer_mode)
        return EarlyTokenizer(spec, load_text_tokenizer(spec))
    except Exception:  # noqa: BLE001 - see load_early_tokenizer: the core's message comes first
        return None


def _lower_this_threads_priority() -> None:
    """nice + 10 for the calling thread alone: Linux only, where nice values are per thread
    (elsewhere the whole process would be reniced)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + 10)


def tokenizer_for(spec: TokenizerSpec, early: EarlyTokenizer | None) -> Any:
    """The tokenizer of the engine core's `spec`: the early one if it matches."""
    if early is not None and early.spec == spec:
        return early.tokenizer
    return load_text_tokenizer(spec)
