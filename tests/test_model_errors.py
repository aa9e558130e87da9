"""Model files that cannot be used: one error naming the file and the problem, exit code 2.

Each broken model is a copy of the tiny llama (or the embedded GGUF) with one thing wrong.
The loader is checked for every case; `pagellm serve` for two, end to end.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagellm.model.errors import ModelLoadError
from pagellm.model.loader import load_model
from server_utils import run_cli


def _truncate(file: Path, size: int) -> None:
    file.write_bytes(file.read_bytes()[:size])


def _edit_config(folder: Path, change: Callable[[dict], dict]) -> None:
    config = folder / "config.json"
    config.write_text(json.dumps(change(json.loads(config.read_text()))))


def _missing_shard(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}))


# case: (what to break, the file the error must name, words of the problem)
HF_CASES: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "truncated safetensors header": (lambda d: _truncate(d / "model.safetensors", 100),
                                     "model.safetensors", "not a readable safetensors file"),
    "truncated safetensors data": (
        lambda d: _truncate(d / "model.safetensors", (d / "model.safetensors").stat().st_size // 2),
        "model.safetensors", "incomplete metadata"),
    "garbage config.json": (lambda d: (d / "config.json").write_text("{not json"),
                            "config.json", "not a usable model config"),
    "config.json lacks a key": (
        lambda d: _edit_config(d, lambda c: {k: v for k, v in c.items()
                                             if k != "num_hidden_layers"}),
        "config.json", "lacks the key 'num_hidden_layers'"),
    "config.json does not match the weights": (
        lambda d: _edit_config(d, lambda c: {**c, "hidden_size": c["hidden_size"] // 2}),
        "", "has shape"),
    "missing config.json": (lambda d: (d / "config.json").unlink(), "",
                            "neither a .gguf file nor a folder with config.json"),
    "unsupported architecture": (lambda d: _edit_config(d, lambda c: {**c, "model_type": "gpt2"}),
                                 "config.json", "Unsupported model_type 'gpt2'"),
    "missing shard": (_missing_shard, "model.safetensors.index.json",
                      "model-00002-of-00002.safetensors"),
    "tokenizer that does not load": (lambda d: (d / "tokenizer.json").write_text("{broken"),
                                     "", "the tokenizer does not load"),
}


def _broken_copy(source: Path, target: Path, breaks: Callable[[Path], None]) -> Path:
    shutil.copytree(source, target)
    breaks(target)
    return target


@pytest.mark.parametrize("case", HF_CASES)
def test_bad_hf_model_names_file_and_problem(case: str, tiny_llama_dir: Path,
                                             tmp_path: Path) -> None:
    breaks, file, problem = HF_CASES[case]
    folder = _broken_copy(tiny_llama_dir, tmp_path / "model", breaks)
    with pytest.raises(ModelLoadError) as raised:
        load_model(str(folder), torch.float32, torch.device("cpu")).text  # noqa: B018 - the
        # tokenizer loads at first use (the offline LLM's start; a server's front end)
    message = str(raised.value)
    assert message.startswith(f"{folder / file}".rstrip("/") + ":"), message
    assert problem in message and "\n" not in message


@pytest.mark.parametrize("size", [1000, None], ids=["header", "tensor data"])
def test_truncated_gguf_names_file(size: int | None, smollm2_gguf: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    data = smollm2_gguf.read_bytes()
    broken.write_bytes(data[:size or len(data) // 2])
    with pytest.raises(ModelLoadError) as raised:
        load_model(str(broken), torch.float32, torch.device("cpu"))
    assert str(raised.value).startswith(f"{broken}: not a readable GGUF file (truncated or corrupt)")


def test_corrupt_gguf_names_file(tmp_path: Path) -> None:
    broken = tmp_path / "garbage.gguf"
    broken.write_bytes(b"GGUF" + b"\xff" * 4096)
    with pytest.raises(ModelLoadError, match=f"^{broken}: not a readable GGUF file"):
        load_model(str(broken), torch.float32, torch.device("cpu"))


# the tokenizer: the server loads its own while the engine core loads the weights
@pytest.mark.parametrize("case", ["truncated safetensors data", "missing shard",
                                  "tokenizer that does not load"])
def test_serve_bad_model_is_one_line_exit_2(case: str, tiny_llama_dir: Path,
                                            tmp_path: Path) -> None:
    breaks, file, problem = HF_CASES[case]
    folder = _broken_copy(tiny_llama_dir, tmp_path / "model", breaks)
    result = run_cli("serve", str(folder), "--port", "0",
                     env={"PAGELLM_LOGGING_LEVEL": "WARNING"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr  # that line, and nothing else
    assert result.stderr.startswith(f"pagellm: error: {folder / file}: "), result.stderr
    assert problem in result.stderr
