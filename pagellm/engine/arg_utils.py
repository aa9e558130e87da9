"""Engine arguments with vLLM's names; the CLI and the `LLM` class both build these."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from pagellm.config import CacheConfig, ModelConfig, SchedulerConfig, parse_kv_transfer_config
from pagellm.distributed.config import PARALLEL_FIELDS, ParallelArgs
from pagellm.spec_decode.config import SpeculativeConfig, parse_speculative_config
from pagellm.lora.config import LoRAConfig
from pagellm.mistral.formats import ModelFormats
from pagellm.structured_outputs.params import StructuredOutputsConfig

_GIB = 1 << 30

_HELP = {
    "model": "local HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    "tokenizer": "tokenizer folder, if not the model's own",
    "tokenizer_mode": "auto, hf or mistral (vLLM's slow is refused): mistral tokenizes and encodes chats with "
                      "mistral-common (tekken.json or tokenizer.model.v*); auto: mistral for a "
                      "folder in Mistral's format that has one, the HF tokenizer otherwise",
    "config_format": "auto, hf or mistral: read config.json or Mistral's params.json (auto: "
                     "config.json where there is one, else params.json)",
    "load_format": "auto, safetensors, gguf or mistral: mistral reads consolidated*.safetensors "
                   "with Mistral's tensor names (auto: mistral with --config-format mistral, "
                   "else the file's own)",
    "dtype": "auto, float32, bfloat16 or float16 (auto: bf16 where the hardware has it; a "
             "GGUF on CPU: float32 around its int8 projections)",
    "max_model_len": "context length (prompt + output); default: the model's",
    "seed": "seed of the engine's random generator",
    "block_size": "tokens per KV cache block",
    "kv_cache_dtype": "auto, bfloat16, float16, float32, fp8 (e4m3), fp8_e4m3 or fp8_e5m2: the "
                      "dtype keys and values are stored in (auto: the model's; a GGUF on CPU: "
                      "bfloat16 where the CPU has it); bfloat16 under "
                      "a float32 model halves the cache's memory and speeds up decode attention "
                      "on CPU; fp8 halves it again, at some accuracy",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use (CUDA)",
    "kv_cache_memory": "KV cache budget in bytes (CPU: default 4 GiB, also "
                       "VLLM_CPU_KVCACHE_SPACE in GiB; CUDA: instead of gpu_memory_utilization)",
    "num_gpu_blocks_override": "exact number of KV cache blocks (testing)",
    "max_num_seqs": "most requests in one step",
    "max_num_batched_tokens": "token budget of one step (the chunked-prefill size)",
    "chat_template": "a Jinja chat template file or string overriding the model's",
    "served_model_name": "the model name the API answers to",
    "device": "auto, cpu or cuda",
    "enable_prefix_caching": "reuse the KV blocks of earlier requests' common prefixes",
    "disable_hybrid_kv_cache_manager": "keep every KV block of sliding-window layers (Gemma 3's "
                                       "local layers); by default they give back the blocks "
                                       "that left their window, so a long request costs about "
                                       "the full-attention layers' memory only",
    "kv_offloading_size": "GiB of a second KV tier in host memory (CPU RAM, pinned on CUDA) that "
                          "keeps prefix blocks evicted from the KV cache and swapped-out requests",
    "kv_offloading_path": "memory-map a file at this path for the second KV tier instead of "
                          "RAM (pagellm extension; size from --kv-offloading-size)",
    "kv_transfer_config": "vLLM's KV connector JSON; only OffloadingConnector is supported, "
                          "sized by kv_connector_extra_config.cpu_bytes_to_use",
    "preemption_mode": "auto, swap or recompute: how a preempted request keeps its KV (swap "
                       "needs the second KV tier; auto picks the cheaper per request)",
    "gguf_quantized_max_tokens": "steps of at most this many tokens multiply a GGUF's "
                                 "Q4_0/Q4_1/Q4_K/Q5_K/Q8_0 matrices as stored (pagellm's CPU "
                                 "kernel), the dequantized weights above; default: measured "
                                 "at start-up (any size, with no dequantized copy, where int8 "
                                 "activations beat the dense matmul); 0: always the "
                                 "dequantized weights",
    "gguf_int8_activations": "multiply a GGUF's codes with the activations rounded to int8 "
                             "per 32 inputs, as llama.cpp does (on AVX2, twice float32's speed "
                             "for 4-bit codes, 1.2x for 8-bit ones; on AMX tiles where the CPU "
                             "has them; without batch invariance, in steps of 12 tokens or "
                             "more); never with --dtype float32; --no-gguf-int8-activations: "
                             "float32, the exact dequantized model",
    "batch_invariant": "a request's logits are the same whatever else is in its step, however "
                       "its prompt is chunked and whether its prefix was cached (GGUF models on "
                       "CPU): each projection multiplies one form at every step size, and "
                       "decodes attend through a kernel bit-identical to the prefill one; "
                       "--no-batch-invariant times the fastest form per step size at start-up "
                       "instead",
    "structured_outputs_config": "vLLM's structured outputs JSON: backend (auto, xgrammar or "
                                 "guidance), disable_fallback, disable_any_whitespace, "
                                 "disable_additional_properties (guidance), and pagellm's "
                                 "max_whitespace (longest run of whitespace a JSON grammar "
                                 "allows, default 4) and compile_timeout_s (default 10)",
    "speculative_config": "vLLM's speculative decoding JSON: method ngram (num_speculative_"
                          "tokens, prompt_lookup_max, prompt_lookup_min) or draft_model (model: "
                          "a smaller model with the same tokenizer, num_speculative_tokens, "
                          "draft_sample_method greedy or probabilistic); pagellm's "
                          "disable_adaptive keeps k fixed instead of drafting only what pays",
    "speculative_model": "old spelling: '[ngram]' or a draft model (with "
                         "--num-speculative-tokens)",
    "num_speculative_tokens": "old spelling of speculative_config num_speculative_tokens",
    "ngram_prompt_lookup_max": "old spelling of speculative_config prompt_lookup_max",
    "ngram_prompt_lookup_min": "old spelling of speculative_config prompt_lookup_min",
    "enable_lora": "serve LoRA adapters (PEFT folders) on top of the model; a request picks "
                   "one by its model name",
    "max_loras": "most distinct LoRA adapters in one step (adapter slots)",
    "max_lora_rank": "largest LoRA rank an adapter may have (1, 8, 16, 32, 64, 128, 256, 320 "
                     "or 512): the size of the slots",
    "max_cpu_loras": "loaded LoRA adapters kept in host memory, least recently used evicted "
                     "first (default: --max-loras)",
    "runner": "auto, generate or pooling: generate text, or embed (auto: pooling for an "
              "encoder-only model such as BertModel, generate otherwise)",
    "convert": "auto, none or embed: embed turns a decoder into an embedding model (last-token "
               "pooling unless --pooler-config says otherwise)",
    "pooler_config": "JSON overriding the pooling read from the model (sentence-transformers' "
                     "modules.json): pooling_type MEAN, CLS or LAST, normalize true/false",
}


@dataclass
class EngineArgs(ParallelArgs):
    """The parallel flags come from ParallelArgs (their CLI spellings, short forms included,
    from pagellm.distributed.config.add_parallel_cli_args)."""

    model: str | None = None
    tokenizer: str | None = None
    tokenizer_mode: str = "auto"
    config_format: str = "auto"
    load_format: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    chat_template: str | None = None
    served_model_name: str | None = None
    device: str = "auto"
    enable_prefix_caching: bool = True
    disable_hybrid_kv_cache_manager: bool = False
    kv_offloading_size: float | None = None
    kv_offloading_path: str | None = None
    kv_transfer_config: str | None = None
    preemption_mode: str = "auto"
    gguf_quantized_max_tokens: int | None = None
    gguf_int8_activations: bool = True
    batch_invariant: bool = True
    structured_outputs_config: str | None = None
    speculative_config: str | None = None  # offline, a dict too
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    ngram_prompt_lookup_max: int | None = None
    ngram_prompt_lookup_min: int | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: str | None = None

    def lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def model_config(self) -> ModelConfig:
        if self.gguf_quantized_max_tokens is not None and self.gguf_quantized_max_tokens < 0:
            raise ValueError("gguf_quantized_max_tokens must be at least 0, got "
                             f"{self.gguf_quantized_max_tokens}.")
        if self.gguf_quantized_max_tokens and self.batch_invariant:
            raise ValueError("gguf_quantized_max_tokens chooses a form by step size, which "
                             "batch invariance rules out: set batch_invariant=False "
                             "(--no-batch-invariant) with it.")
        formats = ModelFormats(self.tokenizer_mode, self.config_format, self.load_format)
        formats.validate()
        if self.tokenizer_mode == "mistral" and self.chat_template is not None:
            raise ValueError("chat_template is not supported with tokenizer_mode 'mistral': "
                             "mistral-common encodes conversations in Mistral's own format.")
        return ModelConfig(model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
                           tokenizer_mode=self.tokenizer_mode,
                           config_format=self.config_format, load_format=self.load_format,
                           max_model_len=self.max_model_len, seed=self.seed,
                           chat_template=self.chat_template,
                           served_model_name=self.served_model_name,
                           gguf_quantized_max_tokens=self.gguf_quantized_max_tokens,
                           gguf_int8_activations=self.gguf_int8_activations,
                           batch_invariant=self.batch_invariant)

    def cache_config(self) -> CacheConfig:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}.")
        # imported here, not above: parsing flags (`pagellm --help`, `bench serve`) does
        # without torch, 1.5 s to import
        import torch

        from pagellm.platform import resolve_kv_cache_dtype

        resolve_kv_cache_dtype(self.kv_cache_dtype, torch.float32)  # a bad name fails here
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}.")
        return CacheConfig(block_size=self.block_size, cache_dtype=self.kv_cache_dtype,
                           gpu_memory_utilization=self.gpu_memory_utilization,
                           kv_cache_memory=self.kv_cache_memory,
                           num_gpu_blocks_override=self.num_gpu_blocks_override,
                           enable_prefix_caching=self.enable_prefix_caching,
                           offload_bytes=self.offload_bytes(),
                           offload_path=self.kv_offloading_path,
                           disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager)

    def offload_bytes(self) -> int:
        """Bytes of the second KV tier, from kv_offloading_size or kv_transfer_config; 0: none."""
        if self.kv_transfer_config is not None and self.kv_offloading_size is not None:
            raise ValueError("set either kv_offloading_size or kv_transfer_config, not both.")
        if self.kv_transfer_config is not None:
            size = parse_kv_transfer_config(self.kv_transfer_config, self.block_size)
        elif self.kv_offloading_size is not None:
            size = int(self.kv_offloading_size * _GIB)
        elif self.kv_offloading_path is not None:
            raise ValueError("kv_offloading_path needs a size: set kv_offloading_size.")
        else:
            return 0
        if size <= 0:
            raise ValueError(f"the KV offloading size must be positive, got {size} bytes.")
        return size

    def runner_kind(self) -> str:
        """`generate` or `pooling`: which engine serves this model (pagellm.pooling.config)."""
        from pagellm.model.paths import resolve_model_path
        from pagellm.pooling.config import resolve_runner

        return resolve_runner(resolve_model_path(self.model), self.runner, self.convert)

    def grammar_config(self) -> StructuredOutputsConfig:
        """The parsed --structured-outputs-config."""
        return StructuredOutputsConfig.parse(self.structured_outputs_config)

    def speculative(self) -> SpeculativeConfig | None:
        """The parsed --speculative-config (or its old flags); None: no speculation."""
        return parse_speculative_config(self.speculative_config, self.speculative_model,
                                        self.num_speculative_tokens,
                                        self.ngram_prompt_lookup_max,
                                        self.ngram_prompt_lookup_min)

    def scheduler_config(self) -> SchedulerConfig:
        config = SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                 max_num_batched_tokens=self.max_num_batched_tokens,
                                 preemption_mode=self.preemption_mode,
                                 max_loras=self.max_loras if self.enable_lora else 0)
        config.validate()
        self.lora_config()  # bad LoRA limits fail with the other flags
        if config.preemption_mode == "swap" and not self.offload_bytes():
            raise ValueError("preemption_mode 'swap' needs a second KV tier: set "
                             "kv_offloading_size or kv_transfer_config.")
        return config

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """Add one `--flag-name` per field, with vLLM's spelling."""
        for field in fields(cls):
            if field.name in skip or field.name in PARALLEL_FIELDS:
                continue
            flag = "--" + field.name.replace("_", "-")
            if field.type == "bool":
                parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                    default=field.default, help=_HELP[field.name])
                continue
            kind = {"int": int, "float": float}.get(str(field.type).split(" ")[0], str)
            parser.add_argument(flag, type=kind, default=field.default, help=_HELP[field.name])

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(namespace, f.name) for f in fields(cls)
                      if hasattr(namespace, f.name)})
