"""The pooling engine: embedding models, batched.

`PoolingEngine` loads the model and embeds lists of token ids in micro-batches (sorted
by length, at most `max_num_seqs` inputs and `max_num_batched_tokens` padded tokens
each). `AsyncPoolingEngine` serves it: concurrent requests queue up, and a worker
thread takes everything pending as one batch, so ten clients sending one text each
cost one forward, not ten. torch releases the GIL in its kernels, so the event loop
keeps answering while a batch runs.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from pagellm.engine.arg_utils import EngineArgs
from pagellm.logger import init_logger
from pagellm.model.bert import BertModel, read_bert_config
from pagellm.model.errors import reading
from pagellm.model.loader import load_model, materialize, safetensors_weights
from pagellm.model.paths import resolve_model_path
from pagellm.platform import default_device, dtype_name, resolve_dtype
from pagellm.pooling.config import PoolerConfig, is_encoder_model, read_pooler_config
from pagellm.pooling.runner import DecoderRunner, EncoderRunner
from pagellm.tokenizer import load_tokenizer

logger = init_logger(__name__)
_GIB = float(1 << 30)


@dataclass
class PoolingModelInfo:
    max_model_len: int  # the longest input, in tokens (an encoder's max_seq_length)
    dimensions: int
    vocab_size: int
    pooler: PoolerConfig
    encoder: bool


def plan_batches(lengths: list[int], max_seqs: int, max_tokens: int) -> list[list[int]]:
    """Indices of inputs grouped by similar length, each group within both budgets
    (a group's padded size is its count times its longest input); never empty groups."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for index in order:
        group = groups[-1] if groups else None
        if (group is None or len(group) >= max_seqs
                or (len(group) + 1) * lengths[index] > max_tokens):
            groups.append([index])
        else:
            group.append(index)
    return groups


def _encoder_dtype(path: Path, requested: str, device: torch.device) -> torch.dtype:
    """auto: the checkpoint's own dtype (float32 for MiniLM): encoders are small and their
    users compare vectors with sentence-transformers', computed in float32."""
    if requested != "auto":
        return resolve_dtype(requested, device)
    saved = json.loads((path / "config.json").read_text()).get("torch_dtype", "float32")
    return resolve_dtype(saved if saved in ("float32", "bfloat16", "float16") else "float32",
                         device)


class PoolingEngine:
    def __init__(self, args: EngineArgs) -> None:
        start = time.perf_counter()
        self.args = args
        self.path = resolve_model_path(args.model)
        self.device = default_device() if args.device == "auto" else torch.device(args.device)
        encoder = is_encoder_model(self.path)
        pooler = read_pooler_config(self.path, encoder, args.pooler_config)
        if encoder:
            positions = self._load_encoder(pooler)
        else:
            positions = self._load_decoder(pooler)
        logger.info("Model loading took %.4f GiB and %.6f seconds",
                    self.weight_bytes / _GIB, time.perf_counter() - start)
        self.info = PoolingModelInfo(self._max_model_len(positions, pooler.max_seq_length),
                                     self.dimensions, len(self.tokenizer), pooler, encoder)
        kind = "Encoder-only model" if encoder else "Decoder converted to embeddings"
        logger.info("%s: pooling runner, %s pooling%s, %d dimensions, inputs of at most %d "
                    "tokens; no KV cache is allocated", kind, pooler.pooling_type,
                    " + normalize" if pooler.normalize else "", self.dimensions,
                    self.info.max_model_len)

    def _load_encoder(self, pooler: PoolerConfig) -> int:
        self.dtype = _encoder_dtype(self.path, self.args.dtype, self.device)
        logger.info("Loading %s in %s", self.path, dtype_name(self.dtype))
        with reading(self.path / "config.json", "not a usable BERT config"):
            config = read_bert_config(self.path)
        with torch.device("meta"):
            model = BertModel(config)
        model = materialize(model, self.dtype, self.device).eval()
        with reading(self.path, "the weights do not fit the model"):
            model.load_weights(safetensors_weights(self.path))
        self.weight_bytes = model.weight_bytes()
        with reading(self.path, "the tokenizer does not load"):
            self.tokenizer = load_tokenizer(self.path, self.args.tokenizer)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.runner = EncoderRunner(model, pooler, self.device, pad)
        self.dimensions = config.hidden_size
        return config.max_position_embeddings

    def _load_decoder(self, pooler: PoolerConfig) -> int:
        self.dtype = resolve_dtype(self.args.dtype, self.device)
        logger.info("Loading %s in %s", self.path, dtype_name(self.dtype))
        loaded = load_model(self.args.model, self.dtype, self.device, self.args.tokenizer,
                            self.args.gguf_quantized_max_tokens or 0,
                            self.args.model_config().int8_activations(),
                            formats=self.args.model_config().formats())
        self.weight_bytes = loaded.model.weight_bytes()
        self.tokenizer = loaded.tokenizer
        self.runner = DecoderRunner(loaded.model, loaded.arch, pooler, self.device, self.dtype)
        self.dimensions = loaded.arch.hidden_size
        return loaded.arch.max_position_embeddings

    def _max_model_len(self, positions: int, max_seq_length: int | None) -> int:
        """As vLLM: capped at sentence-transformers' max_seq_length when the model has one."""
        requested = self.args.max_model_len
        if requested is not None and requested > positions:
            raise ValueError(f"max_model_len ({requested}) is greater than the model's maximum "
                             f"context length ({positions}, max_position_embeddings).")
        limit = min(positions, max_seq_length or positions)
        return min(limit, requested) if requested is not None else limit

    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """`[len(inputs), dimensions]` float32 vectors, in the order of `inputs`."""
        args = self.args
        out = torch.empty(len(inputs), self.dimensions)
        lengths = [len(ids) for ids in inputs]
        for group in plan_batches(lengths, args.max_num_seqs, args.max_num_batched_tokens):
            out[group] = self.runner.embed([inputs[i] for i in group])
        return out


@dataclass
class _Job:
    inputs: list[list[int]]
    future: Future


class AsyncPoolingEngine:
    """`await embed(token_id_lists)`; requests arriving while a batch runs form the next."""

    def __init__(self, args: EngineArgs) -> None:
        self.engine = PoolingEngine(args)
        self.info = self.engine.info
        self.tokenizer = self.engine.tokenizer
        self.model_path = self.engine.path
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._run, name="PoolingEngine", daemon=True)
        self._worker.start()

    @property
    def errored(self) -> bool:
        return not self._worker.is_alive()

    async def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        future: Future = Future()
        self._jobs.put(_Job(inputs, future))
        return await asyncio.wrap_future(future)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            jobs = [job]
            while len(jobs) < self.engine.args.max_num_seqs:
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._jobs.put(None)  # stop after this batch
                    break
                jobs.append(more)
            self._run_batch(jobs)

    def _run_batch(self, jobs: list[_Job]) -> None:
        try:
            vectors = self.engine.embed([ids for job in jobs for ids in job.inputs])
        except Exception as error:  # each request fails alone; the worker keeps serving
            logger.error("An embedding batch failed", exc_info=error)
            for job in jobs:
                job.future.set_exception(error)
            return
        start = 0
        for job in jobs:
            job.future.set_result(vectors[start:start + len(job.inputs)])
            start += len(job.inputs)

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._worker.join(timeout=10)
