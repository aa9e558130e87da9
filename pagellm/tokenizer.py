"""Tokenizer, chat template and stop tokens of a local model (HF folder or GGUF file)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagellm.cache_dir import pagellm_cache_dir
from pagellm.logger import init_logger

if TYPE_CHECKING:  # transformers is imported where a tokenizer loads: 1 s of a start
    from transformers import PreTrainedTokenizerBase

logger = init_logger(__name__)


def load_tokenizer(path: Path, tokenizer_override: str | None = None) -> PreTrainedTokenizerBase:
    """A fast tokenizer from `path`, or from `tokenizer_override` (a local folder or .gguf file)."""
    source = tokenizer_source(path, tokenizer_override)
    if source.suffix == ".gguf":
        return load_gguf_tokenizer(source)
    return load_tokenizer_folder(source)


# tokenizer_config.json's classes that are transformers' generic fast tokenizer itself
_GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer_folder(folder: Path) -> PreTrainedTokenizerBase:
    """AutoTokenizer imports transformers' model configurations, and with them torch: 1.3 s
    on one core, in the API server, which needs no torch, and half a second more where torch
    is imported. A folder whose tokenizer is the generic fast one (every GGUF tokenizer
    pagellm caches, and many exports) loads through that class, the very object AutoTokenizer
    would build; any other class (Llama's, Gemma's, ...) goes through AutoTokenizer."""
    tokenizer_class = _read_json(folder / "tokenizer_config.json").get("tokenizer_class")
    if tokenizer_class in _GENERIC_CLASSES and (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def load_mistral_tokenizer(source: Path) -> Any:
    """mistral-common's tokenizer (pagellm.mistral.tokenizer) from `tekken.json` or
    `tokenizer.model.v*` in `source` (or that file itself)."""
    from pagellm.mistral.formats import mistral_tokenizer_file
    from pagellm.model.errors import model_file_error, reading

    file = mistral_tokenizer_file(source)
    if file is None:
        raise model_file_error(source, "tokenizer_mode 'mistral' needs tekken.json or "
                                       "tokenizer.model.v* (mistral-common's files)")
    with reading(file, "mistral-common cannot load this tokenizer"):
        from pagellm.mistral.tokenizer import MistralCommonTokenizer

        return MistralCommonTokenizer(file)


def load_gguf_tokenizer(source: Path) -> PreTrainedTokenizerBase:
    """transformers rebuilds the tokenizer from the GGUF metadata, which reads the whole
    vocabulary field by field: 4.6-4.8 s of CPU for SmolLM2's 49,152 tokens, imports
    included, with pagellm's GGUFFileReader doing gguf's reading. The result is kept as a
    tokenizer folder under pagellm_cache_dir(), keyed by the file and the library versions,
    and loads from there in a tenth of a second."""
    cached = pagellm_cache_dir() / "tokenizers" / gguf_tokenizer_key(source)
    if (cached / "tokenizer_config.json").is_file():
        return load_tokenizer_folder(cached)
    from transformers import AutoTokenizer

    from pagellm.model.gguf_file import gguf_reads_by_file_reader

    with gguf_reads_by_file_reader():
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name,
                                                  local_files_only=True)
    _save_tokenizer(tokenizer, cached)
    return tokenizer


def gguf_tokenizer_key(source: Path) -> str:
    """Changes with the file's path, size or modification time, or the libraries' versions."""
    stat = source.stat()
    key = (f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|"
           f"{importlib.metadata.version('transformers')}|"
           f"{importlib.metadata.version('tokenizers')}")
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Written beside and renamed into place, so that a concurrent start never reads half a
    folder; a cache that cannot be written only costs the next start its 5 seconds."""
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    try:
        tokenizer.save_pretrained(str(partial))
        partial.rename(folder)
    except OSError as error:
        logger.debug("Tokenizer not cached in %s: %s", folder, error)
        shutil.rmtree(partial, ignore_errors=True)


def tokenizer_source(path: Path, tokenizer_override: str | None) -> Path:
    if tokenizer_override is None:
        return path
    source = Path(tokenizer_override).expanduser()
    if not source.exists():
        raise ValueError(f"Tokenizer {tokenizer_override!r} is not a local path: tokenizers cannot "
                         "be downloaded here. Pass a local Hugging Face folder or a .gguf file.")
    return source.resolve()


def find_chat_template(source: Path, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """`chat_template.jinja`, else tokenizer_config.json's, else what the tokenizer carries
    (for a GGUF file: its `tokenizer.chat_template` metadata)."""
    if source.is_dir():
        jinja = source / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        config = _read_json(source / "tokenizer_config.json")
        template = _named_template(config.get("chat_template"))
        if template is not None:
            return template
    return _named_template(tokenizer.chat_template)


def _named_template(template: str | list[dict[str, str]] | dict[str, str] | None) -> str | None:
    """Templates may be stored as a name -> template collection; serve the default one."""
    if isinstance(template, list):
        template = {entry["name"]: entry["template"] for entry in template}
    if isinstance(template, dict):
        return template.get("default")
    return template


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                        chat_template: str | None, add_generation_prompt: bool = True,
                        **template_kwargs: Any) -> list[int]:
    """Render and tokenize a conversation, with exactly one BOS where the tokenizer wants one.

    Templates usually write the BOS text themselves, so the rendered text is encoded without
    special tokens; BOS is prepended only if the tokenizer adds one and the template did not.
    """
    render = getattr(tokenizer, "render_chat", None)
    if render is not None:  # a tokenizer with its own conversation format (mistral-common's)
        return render(messages, chat_template, add_generation_prompt, **template_kwargs)
    if chat_template is None:
        raise ValueError("This model has no chat template; pass one explicitly.")
    text = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer.encode("", add_special_tokens=True)[:1] == [bos]
    if adds_bos and ids[:1] != [bos]:
        ids.insert(0, bos)
    return ids


def eos_token_ids(model_path: Path, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokenizer's EOS first, then any others listed in generation_config.json."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    if model_path.is_dir():
        listed = _read_json(model_path / "generation_config.json").get("eos_token_id")
        ids += _as_list(listed)
    return list(dict.fromkeys(ids))


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}
