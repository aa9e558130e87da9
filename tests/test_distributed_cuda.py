"""Tensor and pipeline parallel ranks on GPUs (NCCL): the same checks as the gloo ones in
test_distributed.py, against the plain single-GPU engine. A machine with one GPU runs a world
of one rank through the executor (process group, preflight, wrapped model) and the refusal of
more ranks than GPUs; the multi-rank checks need as many GPUs as ranks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pagellm import LLM
from test_distributed import ENGINE as CPU_ENGINE, _check_same, _shutdown

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ENGINE = {**CPU_ENGINE, "device": "cuda", "gpu_memory_utilization": 0.2}


@pytest.fixture
def make_llm() -> Iterator[Callable[..., LLM]]:
    made: list[LLM] = []

    def make(model: Path, **kwargs: object) -> LLM:
        made.append(LLM(str(model), **ENGINE, **kwargs))
        return made[-1]

    yield make
    for llm in made:
        _shutdown(llm)
    made.clear()
    torch.cuda.empty_cache()


def _needs_gpus(count: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(torch.cuda.device_count() < count,
                              reason=f"needs {count} GPUs, one per rank")


def test_one_nccl_rank_matches_the_single_gpu_engine(tiny_model_dir: Path,
                                                     make_llm: Callable[..., LLM]) -> None:
    parallel = make_llm(tiny_model_dir, distributed_executor_backend="mp")
    executor = parallel.engine.core.executor
    assert executor is not None and executor.info.backend == "nccl"
    _check_same(make_llm(tiny_model_dir), parallel)


def test_more_ranks_than_gpus_are_refused_in_one_line(tiny_llama_dir: Path) -> None:
    ranks = torch.cuda.device_count() + 1
    with pytest.raises(ValueError) as error:
        LLM(str(tiny_llama_dir), pipeline_parallel_size=ranks, **ENGINE)
    message = str(error.value)
    assert "\n" not in message
    assert f"{ranks} GPUs are needed and {ranks - 1} are visible" in message


@_needs_gpus(2)
def test_tensor_parallel_on_two_gpus(tiny_model_dir: Path,
                                     make_llm: Callable[..., LLM]) -> None:
    _check_same(make_llm(tiny_model_dir), make_llm(tiny_model_dir, tensor_parallel_size=2))


@_needs_gpus(2)
def test_pipeline_parallel_on_two_gpus(tiny_llama_dir: Path,
                                       make_llm: Callable[..., LLM]) -> None:
    """Two stages, two batches in flight: the logits come back to rank 0 on their own group
    while rank 0 sends the next step's hidden states."""
    _check_same(make_llm(tiny_llama_dir), make_llm(tiny_llama_dir, pipeline_parallel_size=2))


@_needs_gpus(4)
def test_tensor_and_pipeline_parallel_on_four_gpus(tiny_model_factory: Callable[[str], Path],
                                                   make_llm: Callable[..., LLM]) -> None:
    model = tiny_model_factory("qwen2")
    _check_same(make_llm(model), make_llm(model, tensor_parallel_size=2,
                                          pipeline_parallel_size=2))
