"""A batch-invariant GGUF's prepared weights are cached: a restart reads them back without
parsing the GGUF and computes the same logits; a changed file is prepared anew."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch

from pagellm.model.loader import LoadedModel, load_model
from pagellm.model.prepared_weights import prepared_path
from pagellm.model.quantized import Linear, form_tensors

from test_models import PagedCache
from tiny_models import write_tiny_gguf

Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
CPU = torch.device("cpu")
PROMPTS = [[5, 9, 33, 2, 71, 8, 19], [40, 41, 42]]


def load(path: Path) -> LoadedModel:
    return load_model(str(path), torch.float32, CPU, tokenizer=str(path.parent / "hf"),
                      gguf_quantized_max_tokens=None, gguf_int8_activations=True,
                      batch_invariant=True)


def logits_of(path: Path) -> torch.Tensor:
    loaded = load(path)
    return PagedCache(loaded.arch).step(loaded.model, list(enumerate(PROMPTS)))


@pytest.fixture()
def tiny_gguf(tiny_model_factory: Callable[[str], Path], tmp_path: Path) -> Path:
    """A tiny GGUF, with its HF folder (for the tokenizer) beside it as `hf`."""
    folder = tiny_model_factory("llama")
    (tmp_path / "hf").symlink_to(folder)
    return write_tiny_gguf(folder, tmp_path / "tiny.gguf", Q4_1, embedding_quantization=Q8_0)


def test_a_restart_reads_the_prepared_weights_and_computes_the_same(
        tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = logits_of(tiny_gguf)
    assert prepared_path(tiny_gguf, torch.float32, True).is_file()

    def no_parsing(*args: object) -> None:
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", no_parsing)  # the tokenizer is HF's
    assert torch.equal(logits_of(tiny_gguf), fresh)



def test_the_quantized_forms_lie_side_by_side_in_one_huge_page_region(tiny_gguf: Path) -> None:
    """Prepared from the file, then read back: every projection's codes, scales and zeros
    in one 2 MiB-aligned allocation (copies_in_huge_pages), which a decode step streams."""
    for _ in range(2):
        model = load(tiny_gguf).model
        tensors = [t for layer in model.modules() if isinstance(layer, Linear)
                   for form in (layer.quantized, layer.int8_panels) if form is not None
                   for t in form_tensors(form)]
        sizes = [t.numel() * t.element_size() for t in tensors]
        first = min(t.data_ptr() for t in tensors)
        end = max(t.data_ptr() + size for t, size in zip(tensors, sizes))
        assert first % (2 << 20) == 0
        assert end - first == sum(-(-size // 64) * 64 for size in sizes[:-1]) + sizes[-1]

def test_a_changed_file_or_form_is_prepared_anew(tiny_gguf: Path) -> None:
    logits_of(tiny_gguf)
    before = prepared_path(tiny_gguf, torch.float32, True)
    assert prepared_path(tiny_gguf, torch.float32, False) != before
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert prepared_path(tiny_gguf, torch.float32, True) != before


def test_an_unreadable_entry_is_rebuilt(tiny_gguf: Path) -> None:
    fresh = logits_of(tiny_gguf)
    entry = prepared_path(tiny_gguf, torch.float32, True)
    entry.write_bytes(b"not a safetensors file")
    assert torch.equal(logits_of(tiny_gguf), fresh)
