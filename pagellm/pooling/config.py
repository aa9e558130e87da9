"""Which runner a model gets, and how its hidden states become one vector.

vLLM's spelling: `--runner auto|generate|pooling`, `--convert auto|none|embed`,
`--pooler-config '{"pooling_type": "MEAN", "normalize": true}'`. An encoder-only
model (`BertModel`) is a pooling model by default; a decoder embeds only when asked
(`--runner pooling` or `--convert embed`), by its last token unless told otherwise.
A sentence-transformers folder says how it pools in `modules.json` (a Pooling module's
`1_Pooling/config.json`, a Normalize module) and how long its inputs may be in
`sentence_bert_config.json` (`max_seq_length`, e.g. 256 for all-MiniLM-L6-v2, half
of BERT's 512 positions).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")
POOLING_TYPES = ("MEAN", "CLS", "LAST")
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_MODES = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS",
             "pooling_mode_lasttoken": "LAST"}


@dataclass
class PoolerConfig:
    pooling_type: str
    normalize: bool = True
    max_seq_length: int | None = None  # the longest input the model was trained on
    matryoshka_dimensions: list[int] | None = None  # None: `dimensions` is refused


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot be read as JSON ({error}).") from None


def is_bert_config(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "bert" or "BertModel" in config.get("architectures", [])


def is_encoder_model(path: Path) -> bool:
    """A Hugging Face folder of a BERT-family encoder (a folder without config.json, as one
    in Mistral's format, is not)."""
    return (path / "config.json").is_file() and is_bert_config(_read_json(path / "config.json"))


def resolve_runner(path: Path, runner: str, convert: str) -> str:
    """`generate` or `pooling` for the model at `path`, as vLLM decides it."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}.")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}, got {convert!r}.")
    encoder = is_encoder_model(path)
    if runner == "generate" and (encoder or convert == "embed"):
        what = "an encoder-only model" if encoder else "asked to embed (--convert embed)"
        raise ValueError(f"{path.name} is {what}; it cannot generate text. Use --runner "
                         "pooling.")
    if runner == "pooling" or convert == "embed" or (runner == "auto" and encoder):
        return "pooling"
    return "generate"


def _sentence_transformers_pooling(path: Path) -> tuple[str | None, bool]:
    """(pooling type, normalize) from modules.json, or (None, False) without one."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None, False
    pooling, normalize = None, False
    for module in _read_json(modules_file):
        if module.get("type") == _ST_NORMALIZE:
            normalize = True
        elif module.get("type") == _ST_POOLING:
            config = _read_json(path / module.get("path", "1_Pooling") / "config.json")
            modes = [kind for key, kind in _ST_MODES.items() if config.get(key)]
            other = [key for key, on in config.items()
                     if key.startswith("pooling_mode") and on and key not in _ST_MODES]
            if other or len(modes) != 1:
                raise ValueError(f"{path.name}: sentence-transformers pooling "
                                 f"{other or modes} is not supported (one of mean, cls or "
                                 "last token).")
            pooling = modes[0]
    return pooling, normalize


def _max_seq_length(path: Path) -> int | None:
    config_file = path / "sentence_bert_config.json"
    if not config_file.is_file():
        return None
    value = _read_json(config_file).get("max_seq_length")
    return int(value) if value else None


def _matryoshka(path: Path) -> list[int] | None:
    config = _read_json(path / "config.json") if (path / "config.json").is_file() else {}
    dims = config.get("matryoshka_dimensions")
    if dims:
        return sorted(int(d) for d in dims)
    return None


def read_pooler_config(path: Path, encoder: bool, override: str | None) -> PoolerConfig:
    """The model's own pooling (sentence-transformers files, else vLLM's default: CLS for
    an encoder, the last token for a decoder, both normalized), then `--pooler-config`."""
    pooling, normalize = (_sentence_transformers_pooling(path) if path.is_dir()
                          else (None, False))
    if pooling is None:
        pooling, normalize = ("CLS" if encoder else "LAST"), True
    config = PoolerConfig(pooling, normalize,
                          _max_seq_length(path) if path.is_dir() else None,
                          _matryoshka(path) if path.is_dir() else None)
    if override:
        apply_override(config, override)
    return config


def apply_override(config: PoolerConfig, text: str) -> None:
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"pooler_config is not valid JSON: {error}.") from None
    if not isinstance(fields, dict):
        raise ValueError("pooler_config must be a JSON object.")
    unknown = set(fields) - {"pooling_type", "normalize"}
    if unknown:
        raise ValueError(f"pooler_config: unsupported key(s) {sorted(unknown)}; pagellm "
                         "supports pooling_type and normalize.")
    if "pooling_type" in fields:
        kind = str(fields["pooling_type"]).upper()
        if kind not in POOLING_TYPES:
            raise ValueError(f"pooler_config: pooling_type must be one of "
                             f"{', '.join(POOLING_TYPES)}, got {fields['pooling_type']!r}.")
        config.pooling_type = kind
    if "normalize" in fields:
        if not isinstance(fields["normalize"], bool):
            raise ValueError("pooler_config: normalize must be true or false.")
        config.normalize = fields["normalize"]
