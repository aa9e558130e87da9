"""vLLM's `--tokenizer-mode`, `--config-format` and `--load-format`, resolved for one model.

`auto` takes the HF form wherever the folder has it (vLLM's order): a folder with both
`config.json` and `params.json` is read as an HF folder unless a flag says `mistral`; one with
`params.json` and `consolidated*.safetensors` but no `config.json` is read in Mistral's
format, and its tokenizer through mistral-common when it ships `tekken.json` or
`tokenizer.model.v*`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagellm.model.errors import model_file_error

TOKENIZER_MODES = ("auto", "hf", "mistral")
CONFIG_FORMATS = ("auto", "hf", "mistral")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "mistral")
PARAMS_FILE = "params.json"


@dataclass(frozen=True)
class ModelFormats:
    tokenizer_mode: str = "auto"
    config_format: str = "auto"
    load_format: str = "auto"

    def validate(self) -> None:
        if self.tokenizer_mode == "slow":
            raise ValueError("tokenizer_mode 'slow' is not supported: pagellm decodes through "
                             "fast (tokenizers-backed) tokenizers; use auto or hf.")
        for name, value, choices in (("tokenizer_mode", self.tokenizer_mode, TOKENIZER_MODES),
                                     ("config_format", self.config_format, CONFIG_FORMATS),
                                     ("load_format", self.load_format, LOAD_FORMATS)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}.")

    def resolved(self, path: Path) -> "ModelFormats":
        """Every `auto` replaced by what the model at `path` holds."""
        self.validate()
        native = is_mistral_folder(path)
        config = self.config_format
        if config == "auto":
            config = "mistral" if native else "hf"
        load = self.load_format
        if load == "auto":
            load = ("gguf" if path.suffix == ".gguf" else
                    "mistral" if config == "mistral" else "safetensors")
        if path.suffix == ".gguf" and (load, config) != ("gguf", "hf"):
            raise model_file_error(path, f"a .gguf file has its own config and weights, not "
                                         f"load_format {load!r} / config_format {config!r}")
        if load == "gguf" and path.suffix != ".gguf":
            raise model_file_error(path, "load_format 'gguf' needs a .gguf file")
        mode = self.tokenizer_mode
        if mode == "auto":
            mode = "mistral" if config == "mistral" and mistral_tokenizer_file(path) else "hf"
        return ModelFormats(mode, config, load)


def is_mistral_folder(path: Path) -> bool:
    """params.json and consolidated*.safetensors, and no HF config.json."""
    return (path.is_dir() and (path / PARAMS_FILE).is_file()
            and not (path / "config.json").is_file()
            and any(path.glob("consolidated*.safetensors")))


def mistral_tokenizer_file(path: Path) -> Path | None:
    """`tekken.json`, else the newest `tokenizer.model.v*` (SentencePiece)."""
    if path.is_file():
        return path if path.name == "tekken.json" or ".model.v" in path.name else None
    if not path.is_dir():
        return None
    if (path / "tekken.json").is_file():
        return path / "tekken.json"
    models = sorted(path.glob("tokenizer.model.v*"))
    return models[-1] if models else None
