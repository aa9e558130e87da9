"""The engine core's side of LoRA: the model's projections wrapped, an LRU of loaded adapters
in host memory, and the slots that each step's adapters occupy.

Requests hold the adapter they were admitted with (`Request.lora`), so an adapter evicted
from the host LRU (`--max-cpu-loras`) stays whole for the requests still using it, and one
reloaded in place under the same name gets a new content hash, a new scheduler key and new
prefix-cache hashes, while requests admitted before finish with the weights their KV was
computed with. A slot is keyed by content, so it is refilled only when its content changes.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.logger import init_logger
from pagellm.lora.config import LoRAConfig
from pagellm.lora.layers import LoRALinear, RowGroups, StepMapping, StepState
from pagellm.lora.metrics import LoRAStats
from pagellm.lora.peft import (LoRAAdapterError, LoRAWeights, ModelLayout, ProjectionShape,
                               load_adapter)
from pagellm.lora.request import LoRARequest
from pagellm.model.llama import _FUSED_SHARDS, LlamaForCausalLM
from pagellm.model.quantized import Linear

logger = init_logger(__name__)
_GIB = float(1 << 30)


@dataclass
class LoadedLoRA:
    """An adapter in host memory: its fused weights per projection and its content hash;
    `key` is the scheduler's integer for this content (one slot)."""

    request: LoRARequest
    modules: dict[str, LoRAWeights]
    content_hash: bytes
    key: int


def wrap_projections(model: LlamaForCausalLM, config: LoRAConfig, state: StepState,
                     dtype: torch.dtype, device: torch.device
                     ) -> tuple[ModelLayout, dict[str, LoRALinear]]:
    """Replace each decoder projection by a LoRALinear around it; returns their shapes (with
    the HF names of their shards) and the wrappers, by our module name."""
    layout: ModelLayout = {}
    wrapped: dict[str, LoRALinear] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear) or not name.startswith("model.layers."):
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        shards = sorted((index, hf) for hf, (fused, index) in _FUSED_SHARDS.items()
                        if fused == leaf)
        if shards:
            rows = parent.shard_sizes
            layout[name] = ProjectionShape(module.in_features, tuple(
                (f"{parent_name}.{hf}", rows[index]) for index, hf in shards))
        else:
            layout[name] = ProjectionShape(module.in_features, ((name, module.out_features),))
        wrapper = LoRALinear(module, max(1, len(shards)), config.max_loras,
                             config.max_lora_rank, state, dtype, device)
        setattr(parent, leaf, wrapper)
        wrapped[name] = wrapper
    return layout, wrapped


class LoRAModelManager:
    def __init__(self, model: LlamaForCausalLM, config: LoRAConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config, self.dtype, self.device = config, dtype, device
        self.state = StepState()
        self.layout, self.layers = wrap_projections(model, config, self.state, dtype, device)
        self.cache: OrderedDict[int, LoadedLoRA] = OrderedDict()  # by lora_int_id, LRU first
        self._keys: dict[bytes, int] = {}  # content hash -> scheduler key, stable
        self._next_key = itertools.count(1)
        self.slot_keys = [0] * config.max_loras  # 0: an empty slot
        self._slot_used = [0] * config.max_loras  # step of last use, for LRU replacement
        self._step = 0
        self.requests_per_adapter: Counter[str] = Counter()
        slot_bytes = sum(layer.slot_bytes() for layer in self.layers.values())
        logger.info("LoRA: %d slot(s) of rank up to %d on %d projections (%.3f GiB); up to %d "
                    "adapter(s) in host memory", config.max_loras, config.max_lora_rank,
                    len(self.layers), slot_bytes / _GIB, config.max_cpu_loras)

    def add_lora(self, request: LoRARequest, replace: bool = False) -> LoadedLoRA:
        """Load (or find in the LRU) and check an adapter; `replace` reads its files again."""
        cached = self.cache.get(request.lora_int_id)
        if cached is not None and not replace and cached.request.lora_path == request.lora_path:
            self.cache.move_to_end(request.lora_int_id)
            return cached
        try:
            modules, digest = load_adapter(request.lora_path, self.layout,
                                           self.config.max_lora_rank, self.dtype)
        except LoRAAdapterError as error:
            raise LoRAAdapterError(f"Loading lora {request.lora_name} failed: {error}") from None
        key = self._keys.setdefault(digest, next(self._next_key))
        loaded = LoadedLoRA(request, modules, digest, key)
        self.cache[request.lora_int_id] = loaded
        self.cache.move_to_end(request.lora_int_id)
        while len(self.cache) > self.config.max_cpu_loras:
            self.cache.popitem(last=False)
        ranks = sorted({w.rank for w in modules.values()})
        logger.info("Loaded LoRA adapter %s (id %d, %d projections, fused ranks %s) from %s",
                    request.lora_name, request.lora_int_id, len(modules), ranks,
                    request.lora_path)
        return loaded

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; requests already using it finish with it."""
        return self.cache.pop(lora_int_id, None) is not None

    def attach(self, lora_request: LoRARequest) -> LoadedLoRA:
        """The adapter a new request runs with (loaded again if the LRU evicted it)."""
        self.requests_per_adapter[lora_request.lora_name] += 1
        return self.add_lora(lora_request)

    def activate(self, adapters: Sequence[LoadedLoRA | None]) -> np.ndarray:
        """Give each of the step's adapters a slot (filling it if its content is not there);
        returns each item's slot, -1 for the base model. The scheduler admits at most
        max_loras distinct adapters, so every one finds a slot."""
        self._step += 1
        needed = {lora.key: lora for lora in adapters if lora is not None}
        slot_of = {key: self.slot_keys.index(key) for key in needed if key in self.slot_keys}
        for key, lora in needed.items():
            if key not in slot_of:
                slot_of[key] = self._fill_slot(lora, set(slot_of.values()))
        for slot in slot_of.values():
            self._slot_used[slot] = self._step
        return np.array([-1 if lora is None else slot_of[lora.key] for lora in adapters],
                        dtype=np.int64)

    def _fill_slot(self, lora: LoadedLoRA, taken: set[int]) -> int:
        free = [s for s in range(len(self.slot_keys)) if s not in taken]
        if not free:
            raise RuntimeError(f"more than max_loras ({self.config.max_loras}) adapters in "
                               "one step")
        slot = min(free, key=lambda s: (self.slot_keys[s] != 0, self._slot_used[s]))
        for name, layer in self.layers.items():
            layer.set_slot(slot, lora.modules.get(name))
        self.slot_keys[slot] = lora.key
        return slot

    def set_step(self, token_slots: np.ndarray, output_rows: torch.Tensor) -> None:
        """The step's token -> slot mapping (and its sampled rows'); no adapter: no mapping."""
        tokens = RowGroups.of(token_slots, self.device)
        if tokens is None:
            self.state.mapping = None
            return
        outputs = token_slots[output_rows.cpu().numpy()]
        self.state.mapping = StepMapping(len(token_slots), tokens, len(outputs),
                                         RowGroups.of(outputs, self.device))

    def end_step(self) -> None:
        self.state.mapping = None

    def stats(self, running: Iterable, waiting: Iterable) -> LoRAStats:
        """Adapters of running and waiting requests (names, in first-seen order)."""
        def names(requests: Iterable) -> dict[str, int]:
            return dict(Counter(r.lora_request.lora_name for r in requests if r.lora_request))

        return LoRAStats(self.config.max_loras, names(running), names(waiting),
                         dict(self.requests_per_adapter))
