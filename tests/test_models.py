"""Our model layer against Hugging Face transformers, through the paged KV cache."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from smollm2_reference import TransformersReference
from tiny_models import BOS_ID, EOS_ID, write_tiny_gguf
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from pagellm.model.arch import ArchConfig, arch_from_hf_config
from pagellm.model.attention import build_attention_metadata, kv_cache_shape
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.loader import LoadedModel, instantiate, load_model, safetensors_weights
from pagellm.model.paths import resolve_model_path
from pagellm.tokenizer import apply_chat_template

CPU = torch.device("cpu")
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a small village by the river, where people baked bread "
    "every morning and the children walked to school.",
    "What is the capital of France?",
]
DECODE_STEPS = 32
GGUF_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                    "rope_theta", "max_position_embeddings", "tie_word_embeddings",
                    "bos_token_id", "eos_token_id")


class PagedCache:
    """The engine's part in miniature: per-request block tables over a small KV cache.

    Blocks are handed out in a shuffled order so that every request's table is scattered.
    """

    def __init__(self, arch: ArchConfig, dtype: torch.dtype = torch.float32,
                 num_blocks: int = 128, block_size: int = 4) -> None:
        shape = kv_cache_shape(num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in range(arch.num_hidden_layers)]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.block_size = block_size
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def step(self, model: LlamaForCausalLM, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """One forward over (request id, new tokens) chunks -> logits of each chunk's last token."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for request, tokens in chunks:
            start = self.lengths.get(request, 0)
            self.lengths[request] = start + len(tokens)
            table = self.tables.setdefault(request, [])
            while len(table) * self.block_size < self.lengths[request]:
                table.append(self.free.pop())
            span = range(start, self.lengths[request])
            ids += tokens
            positions += span
            slots += [table[p // self.block_size] * self.block_size + p % self.block_size
                      for p in span]
        query_lens = [len(tokens) for _, tokens in chunks]
        metadata = build_attention_metadata(
            query_lens, [self.lengths[r] for r, _ in chunks], [self.tables[r] for r, _ in chunks],
            torch.tensor(slots), self.block_size, CPU)
        last_tokens = torch.tensor(np.cumsum(query_lens) - 1)
        with torch.inference_mode():  # as the engine asks: the last layer's rows for those only
            hidden = model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, metadata,
                           output_rows=last_tokens)
            return model.compute_logits(hidden)


def greedy_decode(cache: PagedCache, model: LlamaForCausalLM, prefill_logits: torch.Tensor,
                  steps: int) -> list[list[int]]:
    """Decode every request together, one token each per step (request ids 0..n-1)."""
    tokens = [[t] for t in prefill_logits.argmax(-1).tolist()]
    for _ in range(steps - 1):
        logits = cache.step(model, [(i, [seq[-1]]) for i, seq in enumerate(tokens)])
        for seq, token in zip(tokens, logits.argmax(-1).tolist()):
            seq.append(token)
    return tokens


def reference_last_logits(ref: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return ref(torch.tensor([ids])).logits[0, -1].float()


def reference_greedy(ref: PreTrainedModel, ids: list[int], steps: int) -> list[int]:
    """HF greedy continuation; it stops early at an EOS token."""
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        out = ref.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                           max_new_tokens=steps)
    return out[0, len(ids):].tolist()


def assert_matches_transformers(model_dir: Path, steps: int = DECODE_STEPS) -> LoadedModel:
    """PROMPTS prefilled together, then decoded together: last logits within 1e-4 of
    transformers' and greedy tokens identical (up to transformers' EOS), in float32."""
    loaded = load_model(str(model_dir), torch.float32, CPU)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [loaded.tokenizer.encode(text) for text in PROMPTS]
    generated = assert_matches_reference(loaded, ref, prompts, steps, atol=1e-4)
    assert sum(map(len, generated)) >= len(prompts) * steps // 2
    return loaded


def assert_matches_reference(loaded: LoadedModel, ref: PreTrainedModel, prompts: list[list[int]],
                             steps: int, atol: float, block_size: int = 4,
                             greedy: Callable[[list[int], int], list[int]] | None = None
                             ) -> list[list[int]]:
    """Prefill `prompts` together (last logits within `atol`), then decode them together
    (greedy tokens identical up to the reference's EOS); -> the tokens it compared.
    `greedy(ids, steps)`: the reference's answers (a cache of them), else computed."""
    greedy = greedy or (lambda ids, count: reference_greedy(ref, ids, count))
    cache = PagedCache(loaded.arch, num_blocks=128 * 4 // block_size, block_size=block_size)
    logits = cache.step(loaded.model, list(enumerate(prompts)))
    for row, ids in zip(logits, prompts):
        torch.testing.assert_close(row, reference_last_logits(ref, ids), atol=atol, rtol=1e-4)
    compared = []
    for ours, ids in zip(greedy_decode(cache, loaded.model, logits, steps), prompts):
        expected = greedy(ids, steps)
        assert ours[:len(expected)] == expected
        compared.append(expected)
    return compared


def test_batched_prefill_and_decode_match_transformers(tiny_model_dir: Path) -> None:
    assert_matches_transformers(tiny_model_dir)


def test_chunked_prefill_mixed_with_decode(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir), torch.float32, CPU)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    long, short = (loaded.tokenizer.encode(text) for text in (PROMPTS[2], PROMPTS[1]))
    cache = PagedCache(loaded.arch)

    first = cache.step(loaded.model, [(0, long[:10]), (1, short)])
    token = int(first[1].argmax())
    second = cache.step(loaded.model, [(0, long[10:]), (1, [token])])

    for ours, ids in ((first[0], long[:10]), (second[0], long), (second[1], short + [token])):
        torch.testing.assert_close(ours, reference_last_logits(ref, ids), atol=1e-4, rtol=1e-4)


def test_output_rows_are_those_rows_of_the_whole_forward(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir), torch.float32, CPU)
    ids = loaded.tokenizer.encode(PROMPTS[2])
    blocks = -(-len(ids) // 4)
    metadata = build_attention_metadata([len(ids)], [len(ids)], [list(range(blocks))],
                                        torch.arange(len(ids)), 4, CPU)
    arch = loaded.arch
    shape = kv_cache_shape(blocks, 4, arch.num_key_value_heads, arch.head_dim)
    caches = [[torch.zeros(shape) for _ in range(arch.num_hidden_layers)] for _ in range(2)]
    rows = torch.tensor([len(ids) - 1, 3])
    with torch.inference_mode():
        whole = loaded.model(torch.tensor(ids), torch.arange(len(ids)), caches[0], metadata)
        some = loaded.model(torch.tensor(ids), torch.arange(len(ids)), caches[1], metadata,
                            output_rows=rows)
    assert some.shape == (2, arch.hidden_size)
    torch.testing.assert_close(some, whole[rows], atol=1e-5, rtol=1e-5)
    for ours, full in zip(caches[1], caches[0]):  # every token's keys and values, last layer too
        assert torch.equal(ours, full)


def test_gguf_conversion_matches_transformers(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf")
    loaded = load_model(str(path), torch.float32, CPU, tokenizer=str(tiny_model_dir))
    hf_arch = arch_from_hf_config(json.loads((tiny_model_dir / "config.json").read_text()))
    assert (loaded.arch.qk_norm, loaded.arch.attention_bias, loaded.arch.o_proj_bias,
            loaded.arch.tie_word_embeddings) == (hf_arch.qk_norm, hf_arch.attention_bias,
                                                 hf_arch.o_proj_bias, hf_arch.tie_word_embeddings)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [loaded.tokenizer.encode(text) for text in PROMPTS]
    logits = PagedCache(loaded.arch).step(loaded.model, list(enumerate(prompts)))
    for row, ids in zip(logits, prompts):
        torch.testing.assert_close(row, reference_last_logits(ref, ids), atol=1e-4, rtol=1e-4)


def test_bfloat16_is_close_to_float32(tiny_llama_dir: Path) -> None:
    ids = [list(range(3, 40)), list(range(100, 110))]
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        loaded = load_model(str(tiny_llama_dir), dtype, CPU)
        assert loaded.model.model.embed_tokens.weight.dtype == dtype
        logits[dtype] = PagedCache(loaded.arch, dtype).step(loaded.model, list(enumerate(ids)))
    low = logits[torch.bfloat16]
    assert low.dtype == torch.bfloat16 and torch.isfinite(low).all()  # widened by the sampler
    torch.testing.assert_close(low.float(), logits[torch.float32], atol=0.1, rtol=0.05)


def test_tiny_tokenizer_chat_template_and_stop_tokens(tiny_llama_dir: Path) -> None:
    loaded = load_model(str(tiny_llama_dir), torch.float32, CPU)
    assert loaded.chat_template == (tiny_llama_dir / "chat_template.jinja").read_text()
    assert loaded.eos_token_ids == [EOS_ID, BOS_ID]
    messages = [{"role": "user", "content": "Hello!"}]
    ids = apply_chat_template(loaded.tokenizer, messages, loaded.chat_template)
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    assert loaded.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_load_weights_rejects_missing_and_unexpected(tiny_llama_dir: Path) -> None:
    arch = arch_from_hf_config(json.loads((tiny_llama_dir / "config.json").read_text()))
    weights = list(safetensors_weights(tiny_llama_dir))
    model = instantiate(arch, torch.float32, CPU)
    with pytest.raises(ValueError, match="missing 1 weight"):
        model.load_weights(w for w in weights if w[0] != "model.layers.1.self_attn.v_proj.weight")
    with pytest.raises(ValueError, match="Unexpected weight 'model.extra.weight'"):
        model.load_weights([*weights, ("model.extra.weight", torch.zeros(1))])


def test_unknown_model_string_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cannot be downloaded"):
        resolve_model_path("meta-llama/Llama-3.2-1B-Instruct")


def test_unsupported_model_type_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ValueError, match="supported model types are: llama, mistral, qwen2, qwen3"):
        load_model(str(tmp_path), torch.float32, CPU)


def transformers_gguf_model(path: Path, arch: ArchConfig,
                            config: PretrainedConfig | None = None
                            ) -> tuple[PreTrainedModel, dict]:
    """transformers' own GGUF dequantization and renaming, and the config it parsed.

    `from_pretrained(gguf_file=...)` insists on accelerate, so the reference is assembled
    from `load_gguf_checkpoint`; the model skeleton takes our sizes (a Llama's, unless a
    `config` is given), which the test then checks against transformers' parsed config.
    """
    config = config or LlamaConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads, num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps, rope_theta=arch.rope_theta,
        max_position_embeddings=arch.max_position_embeddings, tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # transformers rebuilds gguf-py's name map for each of the ~400 submodules (seconds);
    # the top-level view alone already maps every full parameter name.
    flat = SimpleNamespace(config=model.config, state_dict=model.state_dict,
                           named_children=list)
    parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=flat)
    model.load_state_dict(parsed["tensors"], strict=False, assign=True)
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.eval(), parsed["config"]


def test_smollm2_gguf_matches_transformers(smollm2_gguf: Path, smollm2_float32: LoadedModel,
                                           smollm2_transformers: TransformersReference) -> None:
    loaded = smollm2_float32
    assert loaded.path == smollm2_gguf and loaded.arch.tie_word_embeddings
    ref, ref_config = smollm2_transformers.model, smollm2_transformers.config
    assert {key: getattr(loaded.arch, key) for key in GGUF_CONFIG_KEYS} == {
        key: ref_config[key] for key in GGUF_CONFIG_KEYS}
    tokenizer = loaded.tokenizer

    assert tokenizer.encode("Hello world, how are you?") == [19556, 905, 28, 638, 359, 346, 47]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = apply_chat_template(tokenizer, messages, loaded.chat_template)
    assert ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
    assert loaded.eos_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]

    prompts = [ids, tokenizer.encode("The capital of France is")]
    generated = assert_matches_reference(loaded, ref, prompts, 24, atol=1e-3,
                                         greedy=smollm2_transformers.greedy)
    assert tokenizer.decode(generated[1][:2]).strip().startswith("Paris")

    low_model = copy.deepcopy(loaded.model).to(torch.bfloat16)  # the shared one stays float32
    low = PagedCache(loaded.arch, torch.bfloat16).step(low_model, [(0, ids)])
    assert int(low.argmax()) == generated[0][0]
