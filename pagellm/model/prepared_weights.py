"""A GGUF model's prepared weights, kept between starts.

Preparing a GGUF for the kernels costs most of a start: gguf-py parses every metadata field
(the whole vocabulary, one numpy view per string), the embeddings are dequantized and each
projection's codes are rearranged into the int8 kernel's panels. None of it depends on
anything but the file, the dtype, the chosen forms and the code that lays them out, so the
result is written once to a safetensors file under pagellm's cache directory and read back
by later starts, tensors and all, without opening the GGUF again. The key changes with the
file's path, size and modification time, the dtype, the forms (and whether 4-bit panels hold
two codes per byte, which PAGELLM_AMX changes on a CPU with AMX), the libraries' versions and
the source of the modules that lay the weights out; a stale or unreadable entry is rebuilt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from pagellm.logger import init_logger
from pagellm.model.arch import ArchConfig
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.quantized import GroupQuantWeight, Int8Panels, Linear
from pagellm.tokenizer import pagellm_cache_dir

logger = init_logger(__name__)

_LAYOUT_SOURCES = ("quantized.py", "gguf_weights.py", "llama.py", "gemma3.py", "moe.py",
                   "prepared_weights.py")
# The Linear attributes that say which form a step multiplies.
_FLAGS = ("quantized_max_tokens", "int8_min_tokens", "batch_invariant", "dense_released")


def prepared_path(gguf_path: Path, dtype: torch.dtype, int8_activations: bool) -> Path:
    stat = gguf_path.stat()
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in _LAYOUT_SOURCES:
        digest.update((here / name).read_bytes())
    key = (f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}|{int8_activations}|"
           f"{torch.__version__}|{importlib.metadata.version('gguf')}|"
           f"{digest.hexdigest()}")
    name = hashlib.sha256(key.encode()).hexdigest()[:32]
    return pagellm_cache_dir() / "prepared" / f"{name}.safetensors"


def save_prepared(path: Path, net: LlamaForCausalLM) -> None:
    """Write the model's tensors and forms beside `path`, then rename it into place, so a
    concurrent start never reads half a file; a cache that cannot be written only costs the
    next start its preparation."""
    tensors: dict[str, torch.Tensor] = {}
    for name, param in net.named_parameters():
        if param.numel():
            tensors[f"param/{name}"] = param.data.contiguous()
    layers = {}
    for name, module in net.named_modules():
        if isinstance(module, Linear) and module.quantized_max_tokens:
            layers[name] = _save_forms(name, module, tensors)
    metadata = {"arch": json.dumps(dataclasses.asdict(net.arch)), "layers": json.dumps(layers)}
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(partial), metadata=metadata)
        partial.rename(path)
    except OSError as error:
        logger.debug("Prepared weights not cached in %s: %s", path, error)
        partial.unlink(missing_ok=True)


def _save_forms(name: str, layer: Linear, tensors: dict[str, torch.Tensor]) -> dict:
    info = {flag: getattr(layer, flag) for flag in _FLAGS}
    if layer.int8_panels is not None:
        for field in dataclasses.fields(Int8Panels):
            tensors[f"int8/{name}/{field.name}"] = getattr(layer.int8_panels, field.name)
    if layer.quantized is not None:
        q = layer.quantized
        info["bits"] = q.bits
        tensors[f"codes/{name}/codes"] = q.codes
        tensors[f"codes/{name}/scales"] = q.scales
        if q.zeros is not None:
            tensors[f"codes/{name}/zeros"] = q.zeros
    return info


def load_prepared(path: Path, dtype: torch.dtype,
                  device: torch.device) -> tuple[ArchConfig, LlamaForCausalLM] | None:
    """The model as save_prepared wrote it, or None if there is no usable entry."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            metadata = handle.metadata()
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        arch = ArchConfig(**json.loads(metadata["arch"]))
        layers = json.loads(metadata["layers"])
    except (OSError, SafetensorError, ValueError, KeyError, TypeError) as error:
        logger.warning("Ignoring the unreadable prepared weights %s: %s", path, error)
        return None
    from pagellm.model.loader import instantiate

    net = instantiate(arch, dtype, device)
    for name, info in layers.items():
        _load_forms(name, net.get_submodule(name), info, tensors)
    params = {name.removeprefix("param/"): t for name, t in tensors.items()
              if name.startswith("param/")}
    net.load_state_dict(params, strict=False, assign=True)
    if arch.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    return arch, net.eval().requires_grad_(False)


def _load_forms(name: str, layer: Linear, info: dict, tensors: dict[str, torch.Tensor]) -> None:
    for flag in _FLAGS:
        setattr(layer, flag, info[flag])
    if layer.dense_released:
        layer.weight = nn.Parameter(layer.weight.new_empty(0), requires_grad=False)
    if f"int8/{name}/codes" in tensors:
        layer.int8_panels = Int8Panels(*(tensors[f"int8/{name}/{field.name}"]
                                         for field in dataclasses.fields(Int8Panels)))
    if "bits" in info:
        layer.quantized = GroupQuantWeight(tensors[f"codes/{name}/codes"],
                                           tensors[f"codes/{name}/scales"],
                                           tensors.get(f"codes/{name}/zeros"), info["bits"])
