"""Find a local model, read its architecture and weights, and pair it with its tokenizer."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from pagellm.kernels import bf16_tiles_available, on_demand_kernels_available
from pagellm.logger import init_logger
from pagellm.model.arch import ArchConfig, arch_from_gguf, arch_from_hf_config
from pagellm.model.errors import model_file_error, reading
from pagellm.model.gemma3 import Gemma3ForCausalLM
from pagellm.model.quantized import ANY_TOKENS, GroupQuantWeight, Linear, quantized_supported
from pagellm.model.quantized_timing import (choose_torch_int4, int8_beats_dense,
                                            measure_max_tokens)
from pagellm.model.torch_matmul import packed_weights_supported
from pagellm.model.vision_language import is_vision_language, text_weights
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.moe import MoeForCausalLM
from pagellm.model.paths import resolve_model_path
from pagellm.model.prepared_weights import load_prepared, prepared_path, save_prepared
from pagellm.model.text import ModelText, TokenizerSpec, load_text_tokenizer, model_text
from pagellm.mistral.formats import ModelFormats
from pagellm.mistral.params import has_vision_encoder, read_params
from pagellm.mistral.weights import consolidated_files, mistral_weights
from pagellm.platform import copies_in_huge_pages

if TYPE_CHECKING:
    import gguf

logger = init_logger(__name__)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: ArchConfig
    path: Path
    weights_seconds: float
    tokenizer_spec: TokenizerSpec

    @functools.cached_property
    def text(self) -> ModelText:
        """Loaded at first use (pagellm.model.text): an engine core behind an API server
        needs it only for a grammar or a draft model."""
        return model_text(load_text_tokenizer(self.tokenizer_spec), self.tokenizer_spec,
                          self.arch.model_type)

    @property
    def tokenizer(self) -> Any:
        return self.text.tokenizer

    @property
    def chat_template(self) -> str | None:
        return self.text.chat_template

    @property
    def eos_token_ids(self) -> list[int]:
        return self.text.eos_token_ids


class WeightShard:
    """Every weight whole: the single-process model. A rank of a parallel engine loads its
    part instead (pagellm.distributed.sharding.ShardLayout overrides these)."""

    sliced = False  # read safetensors as slices

    def instantiate(self, arch: ArchConfig, dtype: torch.dtype,
                    device: torch.device) -> LlamaForCausalLM:
        return instantiate(arch, dtype, device)

    def wanted(self, needs_dense: Callable[[str], bool]) -> Callable[[str], bool]:
        return needs_dense

    def dense(self, weights: Iterable[tuple[str, torch.Tensor]]
              ) -> Iterable[tuple[str, torch.Tensor]]:
        return weights

    def quantized(self, weights: Iterable[tuple[str, GroupQuantWeight]]
                  ) -> Iterable[tuple[str, GroupQuantWeight]]:
        return weights


def load_model(model: str | None, dtype: torch.dtype, device: torch.device,
               tokenizer: str | None = None,
               gguf_quantized_max_tokens: int | None = 0,
               gguf_int8_activations: bool = False,
               batch_invariant: bool = False,
               shard_for: Callable[[ArchConfig], WeightShard] | None = None,
               formats: ModelFormats | None = None) -> LoadedModel:
    """`gguf_quantized_max_tokens`: steps of at most this many tokens multiply a GGUF's
    quantized matrices as stored; None measures where that stops paying (under int8
    activations, where the int8 path wins at every size, those get no float weights), 0
    never does.
    `gguf_int8_activations`: those of 12 tokens or more round the activations to int8.
    `batch_invariant` (with `gguf_quantized_max_tokens` None): every step multiplies one
    form, measured nothing (see attach_batch_invariant).
    `shard_for`: this rank's part of the model, for the checkpoint's architecture (a parallel
    engine's rank; no prepared-weights cache).
    `formats`: vLLM's tokenizer mode, config and load formats (pagellm.mistral.formats)."""
    path = resolve_model_path(model)
    formats = (formats or ModelFormats()).resolved(path)
    start = time.perf_counter()
    invariant = batch_invariant and gguf_quantized_max_tokens is None
    if path.suffix == ".gguf" and invariant and shard_for is None:
        arch, net = load_invariant_gguf_model(path, dtype, device, gguf_int8_activations)
    elif path.suffix == ".gguf":
        reader, arch = read_gguf(path)
        with reading(path, "its tensors do not load"):
            net = load_gguf_model(reader, arch, dtype, device, gguf_quantized_max_tokens,
                                  gguf_int8_activations, invariant,
                                  shard_for(arch) if shard_for else None)
    else:
        arch, net = load_folder_model(path, formats, dtype, device, shard_for)
    seconds = time.perf_counter() - start
    logger.info("Loading weights took %.2f seconds", seconds)

    return LoadedModel(net, arch, path, seconds,
                       TokenizerSpec(path, tokenizer, formats.tokenizer_mode))


def load_folder_model(path: Path, formats: ModelFormats, dtype: torch.dtype,
                      device: torch.device, shard_for: Callable[[ArchConfig], WeightShard] | None
                      ) -> tuple[ArchConfig, LlamaForCausalLM]:
    """A folder's config (config.json or params.json) and safetensors weights (HF's or
    Mistral's consolidated ones)."""
    vision_language = False
    if formats.config_format == "mistral":
        arch = read_params(path)
    else:
        config = path / "config.json"
        with reading(config, "not a usable model config"):
            hf_config = json.loads(config.read_text())
            vision_language = is_vision_language(hf_config)
            arch = arch_from_hf_config(hf_config)
    shard = shard_for(arch) if shard_for else WeightShard()
    net = shard.instantiate(arch, dtype, device)
    if formats.load_format == "mistral":
        files = consolidated_files(path)
        with reading(files[0] if len(files) == 1 else path, "the weights do not fit the model"):
            net.load_weights(shard.dense(mistral_weights(path, arch, has_vision_encoder(path))))
    else:
        weights = safetensors_weights(path, shard.sliced)
        with reading(path, "the weights do not fit the model"):
            net.load_weights(shard.dense(text_weights(weights) if vision_language else weights))
    pack_if_supported(net, dtype, device)
    return arch, net


def read_gguf(path: Path) -> tuple[gguf.GGUFReader, ArchConfig]:
    """gguf (and gguf_weights.py) are imported here, where a file is read, not with this
    module: the import costs half a second (gguf-py pulls in mistral-common), which a
    restart from the prepared-weights cache never needs."""
    from pagellm.model.gguf_file import GGUFModelReader
    from pagellm.model.gguf_weights import check_tensor_types

    with reading(path, "not a readable GGUF file (truncated or corrupt)"):
        reader = GGUFModelReader(path)
    with reading(path, "unsupported model"):
        arch = arch_from_gguf(reader)
        check_tensor_types(reader)
        return reader, arch


def load_invariant_gguf_model(path: Path, dtype: torch.dtype, device: torch.device,
                              int8_activations: bool) -> tuple[ArchConfig, LlamaForCausalLM]:
    """A batch-invariant GGUF model: its prepared weights from the cache, or prepared from
    the file and cached (prepared_weights.py)."""
    cached = prepared_path(path, dtype, int8_activations)
    prepared = load_prepared(cached, dtype, device) if quantized_supported(device) else None
    if prepared is not None:
        logger.info("Prepared weights read from %s", cached)
        arch, net = prepared
        pack_if_supported(net, dtype, device)
        build_float_kernel_if_used(net)
    else:
        reader, arch = read_gguf(path)
        with reading(path, "its tensors do not load"):
            net = load_gguf_model(reader, arch, dtype, device, None, int8_activations,
                                  batch_invariant=True)
        if quantized_supported(device):
            save_prepared(cached, net)
    if device.type == "cpu":
        quantized_forms_into_huge_pages(net)
    return arch, net


def quantized_forms_into_huge_pages(net: torch.nn.Module) -> None:
    """Every projection's quantized forms, copied together into 2 MiB pages
    (copies_in_huge_pages): the weights a decode step reads whole."""
    forms = [form for layer in net.modules() if isinstance(layer, Linear)
             for form in layer.quantized_forms()]
    places = [(form, field.name) for form in forms for field in dataclasses.fields(form)
              if isinstance(getattr(form, field.name), torch.Tensor)]
    copies = copies_in_huge_pages([getattr(form, field) for form, field in places])
    for (form, field), copy in zip(places, copies):
        setattr(form, field, copy)


def load_gguf_model(reader: gguf.GGUFReader, arch: ArchConfig, dtype: torch.dtype,
                    device: torch.device, max_tokens: int | None, int8_activations: bool,
                    batch_invariant: bool, shard: WeightShard | None = None) -> LlamaForCausalLM:
    """With `shard`, one rank's part of the model (pagellm.distributed.sharding)."""
    from pagellm.model.gguf_weights import gguf_quantized_weights, gguf_weights

    shard = shard or WeightShard()
    net = shard.instantiate(arch, dtype, device)
    layers = []
    if max_tokens != 0 and quantized_supported(device):
        weights = shard.quantized(gguf_quantized_weights(reader, arch))
        if batch_invariant and max_tokens is None:
            layers = attach_batch_invariant(net, weights, int8_activations)
        else:
            layers = attach_quantized(net, weights, max_tokens, int8_activations, dtype)
    wanted = shard.wanted(net.needs_dense)
    net.load_weights(shard.dense(gguf_weights(reader, arch, wanted=wanted)))
    pack_if_supported(net, dtype, device)
    if layers and not layers[0].batch_invariant:
        choose_quantized_sizes(layers, max_tokens, dtype)
    build_float_kernel_if_used(net)
    return net


def build_float_kernel_if_used(net: torch.nn.Module) -> None:
    """The kernel that multiplies codes with float activations is built on demand
    (pagellm.kernels.build.ON_DEMAND_UNITS): where a projection uses it, build or load it now,
    at load, rather than in the first step that needs it."""
    if any(isinstance(layer, Linear) and layer.may_use_float_kernel() for layer in net.modules()):
        on_demand_kernels_available()


def attach_batch_invariant(net: LlamaForCausalLM,
                           weights: Iterable[tuple[str, GroupQuantWeight]],
                           int8_activations: bool) -> list[Linear]:
    """Every quantized projection multiplies one form at every step size and keeps no float
    weights (the tied output projection's are the embedding table); nothing is timed."""
    layers = net.attach_quantized_weights(weights, ANY_TOKENS, int8_activations,
                                          batch_invariant=True)
    for layer in layers:
        if not (layer is net.lm_head and net.arch.tie_word_embeddings):
            layer.release_dense()
    int8 = sum(layer.int8_panels is not None for layer in layers)
    logger.info("Steps multiply the GGUF's quantized weights of %d projections (%s) at every "
                "step size, in one order of sums: batch-invariant", len(layers),
                "with int8 activations" if int8 == len(layers) else
                "in float32, the exact dequantized model" if int8 == 0 else
                f"{int8} with int8 activations, {len(layers) - int8} in float32")
    return layers


def attach_quantized(net: LlamaForCausalLM, weights: Iterable[tuple[str, GroupQuantWeight]],
                     max_tokens: int | None, int8_activations: bool,
                     dtype: torch.dtype) -> list[Linear]:
    """Before the float weights load: a layer whose int8 path beats the dense matmul keeps
    only its quantized form unless a maximum is set (the tied output projection excepted,
    whose float weight is also the embedding table). A bf16 model on AMX-BF16 takes the
    bf16 tiles instead of the int8 path."""
    bf16_tiles = dtype == torch.bfloat16 and bf16_tiles_available()
    layers = net.attach_quantized_weights(weights, max_tokens or 0, int8_activations, bf16_tiles)
    for layer in int8_beats_dense(layers, dtype) if max_tokens is None else ():
        if not (layer is net.lm_head and net.arch.tie_word_embeddings):
            layer.release_dense()
    return layers


def pack_if_supported(net: LlamaForCausalLM, dtype: torch.dtype, device: torch.device) -> None:
    if packed_weights_supported(dtype, device):
        net.pack_dense_weights()


def choose_quantized_sizes(layers: list[Linear], max_tokens: int | None,
                           dtype: torch.dtype) -> None:
    """Once the float weights are in: measure where the layers that kept both forms should
    stop multiplying the quantized one (`max_tokens` None), and log the outcome. First,
    where torch's int4 kernel serves small steps better than pagellm's."""
    int4_shapes = choose_torch_int4(layers)
    if int4_shapes:
        logger.info("Steps of up to N tokens multiply with torch's int4 kernel, measured per "
                    "shape: %s", ", ".join(int4_shapes))
    both = [layer for layer in layers if not layer.dense_released]
    if max_tokens is not None:
        how = f"at most {max_tokens}"
    elif both:
        sizes = measure_max_tokens(both, dtype)
        for layer in both:
            layer.drop_unused_forms()
        how = "measured per shape: " + ", ".join(
            f"{shape} {'any' if n == ANY_TOKENS else n}" for shape, n in sizes.items())
    else:
        how = "any"
    kept = [layer for layer in layers if layer.quantized is not None]
    extra = sum(layer.quantized_bytes() for layer in both) / (1 << 20)
    only = len(layers) - len(both)
    if any(layer.bf16_tiles is not None for layer in kept):
        arithmetic = "widened to bf16 on AMX tiles"
    elif any(layer.int8_panels is not None for layer in kept):
        arithmetic = "with int8 activations"
    else:
        arithmetic = "in float"
    logger.info("Steps multiply the GGUF's quantized weights of %d projections (%s); %d keep "
                "only those, %d also keep float ones (%.1f MiB more memory); tokens per step %s",
                len(kept), arithmetic, only, len(kept) - only, extra, how)


def instantiate(arch: ArchConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """An uninitialized model in `dtype` on `device`, ready for `load_weights`.

    Building on the meta device skips the random initialization, which would
    dominate the load time.
    """
    model_class = (Gemma3ForCausalLM if arch.model_type == "gemma3_text" else
                   MoeForCausalLM if arch.num_experts else LlamaForCausalLM)
    with torch.device("meta"):
        net = model_class(arch)
    return materialize(net, dtype, device).eval().requires_grad_(False)


def materialize(net: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """`net.to(dtype).to_empty(device)` without their meta-tensor path, whose first use
    imports sympy (a second of start-up): every floating parameter and buffer becomes an
    uninitialized tensor of `dtype`, the others keep their type."""
    def empty(tensor: torch.Tensor) -> torch.Tensor:
        kind = dtype if tensor.is_floating_point() else tensor.dtype
        return torch.empty(tensor.shape, dtype=kind, device=device)

    for module in net.modules():
        for name, param in module.named_parameters(recurse=False):
            module._parameters[name] = torch.nn.Parameter(empty(param), requires_grad=False)
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = empty(buffer)
    return net


def safetensors_weights(folder: Path, sliced: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """All tensors of a single-file or sharded (`model.safetensors.index.json`) checkpoint;
    `sliced`: as safetensors slices, of which indexing reads only the part asked for."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with reading(index, "not a usable shard index"):
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / shard for shard in shards]
        missing = [file.name for file in files if not file.is_file()]
        if missing:
            raise model_file_error(index, f"lists {len(missing)} shard(s) that are missing: "
                                          f"{', '.join(missing[:3])}")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise model_file_error(folder, "no *.safetensors weights")
    for file in files:
        with reading(file, "not a readable safetensors file"):
            with safe_open(file, framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    yield name, handle.get_slice(name) if sliced else handle.get_tensor(name)
