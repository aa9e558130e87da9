"""LoRA in the engine: what a bad adapter is told, the --max-loras limit per step, the host
LRU, and prefix-cache keys that follow an adapter's content."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from lora_utils import ADAPTER_CONFIGS, edit_adapter_config, save_peft_adapter
from safetensors.torch import load_file, save_file

from pagellm import LLM, SamplingParams
from pagellm.core.kv_cache_manager import hash_block
from pagellm.lora.peft import LoRAAdapterError
from pagellm.lora.request import LoRARequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-adapters")
    return {name: save_peft_adapter(tiny_llama_dir, root / name, seed, **config)
            for seed, (name, config) in enumerate(ADAPTER_CONFIGS.items())}


def make_llm(model_dir: Path, **kwargs) -> LLM:
    return LLM(str(model_dir), dtype="float32", kv_cache_memory=8 << 20, enable_lora=True,
               **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return make_llm(tiny_llama_dir, max_loras=3)


def prompts(count: int, seed: int = 2) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 40))] for _ in range(count)]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def with_weights(source: Path, folder: Path, edit) -> Path:
    """A copy of an adapter whose tensors `edit` changed."""
    edit_adapter_config(source, folder)
    weights = folder / "adapter_model.safetensors"
    save_file(edit(load_file(weights)), weights)
    return folder


@pytest.mark.parametrize(("changes", "message"), [
    ({"use_dora": True}, "DoRA (use_dora) is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save is not supported"),
    ({"bias": "lora_only"}, "bias='lora_only' is not supported"),
    ({"target_modules": ["c_attn", "c_proj"]}, "match no module of this model"),
    ({"target_modules": ["q_proj", "lm_head"]}, "include lm_head"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
    ({"rank_pattern": {"q_proj": 4}}, "have shapes"),
])
def test_unsupported_or_inconsistent_configs_fail_at_load(llm: LLM, adapters: dict[str, Path],
                                                          tmp_path: Path, changes: dict,
                                                          message: str) -> None:
    folder = edit_adapter_config(adapters["every-projection"], tmp_path / "bad", **changes)
    with pytest.raises(LoRAAdapterError, match=message.replace("(", r"\(").replace(")", r"\)")):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("bad", 90, str(folder)))
    assert not llm.engine.has_unfinished_requests()


def test_bad_weights_fail_at_load(llm: LLM, adapters: dict[str, Path], tmp_path: Path) -> None:
    source = adapters["every-projection"]
    cases = {
        "embedding": (lambda t: {**t, "base_model.model.model.embed_tokens.lora_embedding_A":
                                 torch.zeros(8, 512)}, "unsupported LoRA weight"),
        "shape": (lambda t: {k: v[:, :-1].contiguous() if "lora_A" in k else v
                                 for k, v in t.items()},
                  "an adapter of another model"),
        "half": (lambda t: {k: v for k, v in t.items() if "q_proj.lora_B" not in k},
                 "lack lora_B"),
    }
    for name, (edit, message) in cases.items():
        folder = with_weights(source, tmp_path / name, edit)
        with pytest.raises(LoRAAdapterError, match=message):
            llm.engine.add_lora(LoRARequest(name, 91, str(folder)))
    with pytest.raises(LoRAAdapterError, match="No adapter found"):
        llm.engine.add_lora(LoRARequest("missing", 92, str(tmp_path / "missing")))


def test_rank_above_max_lora_rank_fails(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    small = make_llm(tiny_llama_dir, max_lora_rank=8)  # "patterns" has a rank-16 module
    with pytest.raises(LoRAAdapterError, match="greater than max_lora_rank 8"):
        small.engine.add_lora(LoRARequest("p", 1, str(adapters["patterns"])))


def test_lora_request_without_enable_lora_fails(tiny_llama_dir: Path,
                                                adapters: dict[str, Path]) -> None:
    plain = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=8 << 20)
    with pytest.raises(ValueError, match="--enable-lora"):
        plain.generate([[5, 6]], GREEDY, lora_request=LoRARequest(
            "a", 1, str(adapters["patterns"])))


def test_max_loras_limits_each_step_and_changes_no_answer(tiny_llama_dir: Path, llm: LLM,
                                                          adapters: dict[str, Path]) -> None:
    requests = [LoRARequest(name, i, str(path)) for i, (name, path)
                in enumerate(adapters.items(), 1)]
    batch = prompts(12)
    chosen = [requests[i % 3] if i % 4 else None for i in range(len(batch))]
    expected = tokens(llm.generate(batch, GREEDY, use_tqdm=False, lora_request=chosen))
    one = make_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=1)
    manager = one.engine.core.lora
    seen: list[int] = []
    activate = manager.activate

    def counting(adapters_of_step):
        seen.append(len({lora.key for lora in adapters_of_step if lora is not None}))
        return activate(adapters_of_step)

    manager.activate = counting
    assert tokens(one.generate(batch, GREEDY, use_tqdm=False, lora_request=chosen)) == expected
    assert max(seen) == 1 and len(manager.cache) == 1


def test_prefix_hashes_follow_the_adapter_content(llm: LLM, adapters: dict[str, Path],
                                                  tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Reloaded in place, an adapter's requests miss the blocks cached with its old weights."""
    assert hash_block(None, [1, 2], None) != hash_block(None, [1, 2], None, b"x" * 16)
    assert hash_block(b"p" * 16, [1, 2], None) == hash_block(b"p" * 16, [1, 2], None, b"x" * 16)
    prompt = prompts(1, seed=5)[0] * 3  # several full blocks, cached after the first run
    source = adapters["every-projection"]
    folder = edit_adapter_config(source, tmp_path / "changing")
    request = LoRARequest("changing", 40, str(folder))
    first = tokens(llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=request))
    with_weights(source, folder, lambda t: {k: -v if "lora_B" in k else v for k, v in t.items()})
    llm.engine.core.add_lora(request, replace=True)  # in place: same name and id
    reloaded = tokens(llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=request))
    fresh = make_llm(tiny_llama_dir, max_loras=1)
    expected = tokens(fresh.generate([prompt], GREEDY, use_tqdm=False, lora_request=request))
    assert reloaded == expected != first


def test_siblings_of_n_keep_the_adapter(llm: LLM, adapters: dict[str, Path]) -> None:
    request = LoRARequest("every", 1, str(adapters["every-projection"]))
    prompt = prompts(1, seed=9)[0]
    single = tokens(llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=request))[0]
    base = tokens(llm.generate([prompt], GREEDY, use_tqdm=False))[0]
    params = SamplingParams(n=2, temperature=0.0, max_tokens=10, ignore_eos=True)
    forked = llm.generate([prompt], params, use_tqdm=False, lora_request=request)[0]
    assert [c.token_ids for c in forked.outputs] == [single, single] != [base, base]
