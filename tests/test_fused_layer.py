"""The decoder layer's fused path (model/fused_layer.py, kernels/decoder_layer.cpp): the very
bits of the modules' path, and only where every projection is a plain int8 one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pagellm.model.fused_layer as fused_layer
import pagellm.model.llama as llama_module
from pagellm import LLM, SamplingParams
from pagellm.benchmarks.throughput import random_prompts
from pagellm.model.fused_layer import can_fuse, fused_layer_available

pytestmark = pytest.mark.skipif(not fused_layer_available(),
                                reason="no int8 kernel (AVX2) to fuse around")


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    """The embedded GGUF with its defaults; no prefix cache, so both paths compute every
    token."""
    return LLM(max_num_seqs=8, max_model_len=512, kv_cache_memory=64 << 20,
               enable_prefix_caching=False)


def generate(llm: LLM) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    prompts = random_prompts(6, 40, llm.engine.vocab_size, 7)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                           use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [sorted((t, lp.logprob) for t, lp in step.items()) for step in o.outputs[0].logprobs])
            for o in outputs]


def test_fused_layers_give_the_modules_bits(smollm2: LLM,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    fused = llama_module.fused_forward
    monkeypatch.setattr(llama_module, "fused_forward",
                        lambda *args: calls.append(1) or fused(*args))
    with_fused = generate(smollm2)
    layers = smollm2.engine.core.loaded.arch.num_hidden_layers
    assert len(calls) >= 16 * (layers - 2)  # every step's middle layers
    monkeypatch.setattr(llama_module, "can_fuse", lambda layer, x: False)
    assert generate(smollm2) == with_fused  # tokens and top-5 logprobs, to the bit


def test_only_plain_int8_projections_fuse(smollm2: LLM) -> None:
    layer = smollm2.engine.core.loaded.model.model.layers[1]
    x = torch.zeros(1, smollm2.engine.core.loaded.arch.hidden_size)
    assert can_fuse(layer, x)
    hook = layer.mlp.down_proj.register_forward_hook(lambda *args: None)  # a rank's all-reduce
    assert not can_fuse(layer, x)
    hook.remove()
    assert can_fuse(layer, x)

    class Wrapped(nn.Module):  # as a LoRA adapter wraps a projection
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

    original = layer.self_attn.qkv_proj
    layer.self_attn.qkv_proj = Wrapped(original)
    try:
        assert not can_fuse(layer, x)
    finally:
        layer.self_attn.qkv_proj = original
    assert can_fuse(layer, x)
    assert not can_fuse(layer, x.to("meta"))
    mlp, layer.mlp = layer.mlp, nn.Identity()  # as a MoE model's experts replace it
    try:
        assert not can_fuse(layer, x)
    finally:
        layer.mlp = mlp


def test_decode_steps_attend_within_the_fused_call_with_the_same_bits(
        smollm2: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode-only step writes its keys and values and attends inside
    decode_attention_output; the three calls of other steps give those tokens the same bits."""
    served = []
    choose = fused_layer.invariant_decode_group

    def recording(*args):
        group = choose(*args)
        served.append(group is not None)
        return group

    monkeypatch.setattr(fused_layer, "invariant_decode_group", recording)
    in_one_call = generate(smollm2)
    layers = smollm2.engine.core.loaded.arch.num_hidden_layers
    assert sum(served) >= 15 * (layers - 2)  # the 15 decode-only steps' middle layers
    assert not all(served)  # the prompts' steps attend apart
    monkeypatch.setattr(fused_layer, "invariant_decode_group", lambda *args: None)
    assert generate(smollm2) == in_one_call
