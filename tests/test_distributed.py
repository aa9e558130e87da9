"""Tensor and pipeline parallelism over gloo (CPU ranks, on any machine): the same greedy
tokens and (within 1e-5) the same logits as the single-process engine, on tiny random models
of every architecture and on the embedded GGUF; the preflight's fast failure on a dead
address. NCCL ranks: test_distributed_cuda.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.distributed.group import PreflightError
from pagellm.worker.step_chunk import StepChunk

PROMPTS = ["The quick brown fox", "Hello! How are you today? I am"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ENGINE = {"dtype": "float32", "kv_cache_memory": 1 << 24, "max_model_len": 256,
          "device": "cpu"}


def _shutdown(llm: LLM) -> None:
    executor = llm.engine.core.executor
    if executor is not None:
        executor.shutdown()


@pytest.fixture
def make_llm() -> Iterator[Callable[..., LLM]]:
    """LLMs whose worker processes are stopped when the test ends."""
    made: list[LLM] = []

    def make(model: Path | None, **kwargs: object) -> LLM:
        made.append(LLM(None if model is None else str(model), **ENGINE, **kwargs))
        return made[-1]

    yield make
    for llm in made:
        _shutdown(llm)


def _greedy(llm: LLM) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, GREEDY,
                                                                   use_tqdm=False)]


def _prompt_logits(llm: LLM, prompt: str) -> torch.Tensor:
    """The logits of a prompt's last token, through the runner (and the workers) directly:
    the engine is idle, and blocks from the top of its cache are free."""
    runner = llm.engine.core.runner
    token_ids = llm.get_tokenizer()(prompt)["input_ids"]
    blocks = -(-len(token_ids) // runner.block_size)
    top = llm.engine.core.num_blocks
    logits = runner.compute([StepChunk(token_ids, 0, list(range(top - blocks, top)), 1)]).sampling
    assert logits is not None
    return logits.float()


def _check_same(single: LLM, parallel: LLM) -> None:
    assert _greedy(parallel) == _greedy(single)
    for prompt in PROMPTS:
        expected, got = _prompt_logits(single, prompt), _prompt_logits(parallel, prompt)
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()


def test_one_rank_on_the_mp_executor_matches_the_uni_one(
        tiny_llama_dir: Path, make_llm: Callable[..., LLM]) -> None:
    """A world of one asked to run on `mp` (vLLM runs it so too): the process group of one
    rank, its preflight and the wrapped model, with no worker processes."""
    parallel = make_llm(tiny_llama_dir, distributed_executor_backend="mp")
    assert parallel.engine.core.executor is not None
    assert parallel.engine.core.executor.processes == []
    _check_same(make_llm(tiny_llama_dir), parallel)


def test_tensor_parallel_matches_one_process(tiny_model_dir: Path,
                                             make_llm: Callable[..., LLM]) -> None:
    """Every architecture (GQA: 4 query heads over 2 key/value heads; qwen2's tied head)."""
    _check_same(make_llm(tiny_model_dir), make_llm(tiny_model_dir, tensor_parallel_size=2))


@pytest.mark.parametrize("model_type, tp, pp", [("llama", 1, 2), ("qwen2", 2, 2)])
def test_pipeline_parallel_matches_one_process(model_type: str, tp: int, pp: int,
                                               tiny_model_factory: Callable[[str], Path],
                                               make_llm: Callable[..., LLM]) -> None:
    """One layer per stage; qwen2's tied head sits on the last stage with the embeddings'
    rows. A world of 4 on 2 cores is fine for gloo, one thread per rank."""
    model = tiny_model_factory(model_type)
    _check_same(make_llm(model), make_llm(model, tensor_parallel_size=tp,
                                          pipeline_parallel_size=pp))


def test_key_value_heads_replicated_over_more_ranks(tiny_model_factory: Callable[[str], Path],
                                                    make_llm: Callable[..., LLM]) -> None:
    """4 ranks over 2 key/value heads: each kv head on two ranks, each rank one query head."""
    model = tiny_model_factory("mistral")
    _check_same(make_llm(model), make_llm(model, tensor_parallel_size=4))


def test_embedded_gguf_under_tensor_parallelism(smollm2_gguf: Path,
                                                make_llm: Callable[..., LLM]) -> None:
    """SmolLM2's 9 query and 3 key/value heads split over 3 ranks (2 cannot divide 9); the
    Q4_1 codes stay as stored, cut by rows and by whole groups of 32 columns."""
    single = make_llm(smollm2_gguf)
    parallel = make_llm(smollm2_gguf, tensor_parallel_size=3)
    assert _greedy(parallel) == _greedy(single)


def test_embedded_gguf_under_pipeline_parallelism(smollm2_gguf: Path,
                                                  make_llm: Callable[..., LLM]) -> None:
    """SmolLM2's 30 layers in two stages of 15; the two prompts run as two batches, in
    flight at once."""
    _check_same(make_llm(smollm2_gguf), make_llm(smollm2_gguf, pipeline_parallel_size=2))


def test_heads_that_do_not_divide_are_refused(smollm2_gguf: Path) -> None:
    with pytest.raises(ValueError, match=r"attention heads \(9\) must be divisible by tensor "
                                         r"parallel size \(2\)"):
        LLM(str(smollm2_gguf), tensor_parallel_size=2, **ENGINE)


def test_preflight_fails_fast_on_a_dead_address(tiny_llama_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An address no rank can reach (TEST-NET-3): one line naming the variables to set."""
    monkeypatch.setenv("VLLM_HOST_IP", "203.0.113.1")
    monkeypatch.setenv("PAGELLM_DIST_TIMEOUT", "3")
    with pytest.raises(PreflightError) as error:
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, **ENGINE)
    message = str(error.value)
    assert "\n" not in message and "203.0.113.1" in message
    assert "VLLM_HOST_IP" in message and "GLOO_SOCKET_IFNAME" in message


def test_prompt_logprobs_under_pipeline_parallelism(
        tiny_model_factory: Callable[[str], Path], make_llm: Callable[..., LLM]) -> None:
    """Every rank joins each LM-head call of the scored rows (the last stage sends their
    logits to rank 0); chunks of 5 tokens split the prompts."""
    model = tiny_model_factory("llama")
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)
    results = [[o.prompt_logprobs for o in llm.generate(PROMPTS, params, use_tqdm=False)]
               for llm in (make_llm(model, max_num_batched_tokens=5),
                           make_llm(model, max_num_batched_tokens=5,
                                    pipeline_parallel_size=2))]
    for single, parallel in zip(*results):
        assert len(parallel) == len(single) and parallel[0] is None
        for ours, theirs in zip(parallel[1:], single[1:]):
            assert ours.keys() == theirs.keys()
            assert all(abs(ours[t].logprob - theirs[t].logprob) < 1e-5 for t in ours)
