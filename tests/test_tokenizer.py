"""GGUF tokenizers: rebuilt from the file once, then loaded from pagellm's cache."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from unittest import mock

import pytest
from transformers import AutoTokenizer

from pagellm import tokenizer as tokenizer_module
from pagellm.engine.tokenizer_pool import INLINE_LIMIT, WORKER_NICENESS, TokenizerPool
from pagellm.tokenizer import (apply_chat_template, gguf_tokenizer_key, load_tokenizer,
                               pagellm_cache_dir)

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines ",
         "<|im_start|>user\nspecial tokens inline<|im_end|>", "émigré naïve 日本語 🙂",
         "code: def f(x):\n    return x ** 2  # comment", ""]


def test_gguf_tokenizer_is_cached_and_identical(smollm2_gguf: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    converted = load_tokenizer(smollm2_gguf)
    folder = tmp_path / "tokenizers" / gguf_tokenizer_key(smollm2_gguf)
    assert (folder / "tokenizer.json").is_file()
    assert [p.name for p in (tmp_path / "tokenizers").iterdir()] == [folder.name]

    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF was converted again")

    # the cached folder loads without AutoTokenizer (whose import brings torch), as the
    # same class AutoTokenizer built from the file
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", no_conversion)
    cached = load_tokenizer(smollm2_gguf)

    assert type(cached) is type(converted)
    assert len(cached) == len(converted) == 49152
    assert cached.get_added_vocab() == converted.get_added_vocab()
    assert (cached.bos_token_id, cached.eos_token_id, cached.pad_token_id) == (
        converted.bos_token_id, converted.eos_token_id, converted.pad_token_id)
    for text in TEXTS:
        for special in (True, False):
            ids = converted.encode(text, add_special_tokens=special)
            assert cached.encode(text, add_special_tokens=special) == ids
        assert cached.decode(ids) == converted.decode(ids)
    messages = [{"role": "user", "content": "What is a paged KV cache?"}]
    assert cached.chat_template == converted.chat_template
    assert (apply_chat_template(cached, messages, cached.chat_template)
            == apply_chat_template(converted, messages, converted.chat_template))


def test_the_api_server_and_its_tokenizer_import_no_torch(smollm2_gguf: Path) -> None:
    """The server's modules, and its tokenizer loaded as it loads it while the engine core
    loads the weights, need neither torch nor AutoTokenizer (which imports torch): 1.3 s of
    a restart on the server's CPU core."""
    load_tokenizer(smollm2_gguf)  # the cached folder a restart finds
    code = ("import sys\n"
            "import pagellm.entrypoints.openai.api_server\n"
            "from pagellm.mistral.formats import ModelFormats\n"
            "from pagellm.model.text import load_early_tokenizer, model_text\n"
            "early = load_early_tokenizer(None, None, ModelFormats())\n"
            "text = model_text(early.tokenizer, early.spec, 'llama')\n"
            "print(text.eos_token_ids, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=120)
    eos = load_tokenizer(smollm2_gguf).eos_token_id
    assert result.stdout.split("\n")[-2] == f"[{eos}] False"


def test_gguf_tokenizer_key_follows_the_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    first = gguf_tokenizer_key(path)
    assert gguf_tokenizer_key(path) == first
    os.utime(path, ns=(1, 1))
    touched = gguf_tokenizer_key(path)
    assert touched != first
    path.write_bytes(b"GGUF" + bytes(61))
    os.utime(path, ns=(1, 1))
    assert gguf_tokenizer_key(path) not in (first, touched)
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(path.read_bytes())
    os.utime(copy, ns=(1, 1))
    assert gguf_tokenizer_key(copy) != gguf_tokenizer_key(path)


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "mine"))
    assert pagellm_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("PAGELLM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pagellm_cache_dir() == tmp_path / "xdg" / "pagellm"


class _FolderWriter:
    """Stands in for a tokenizer: save_pretrained writes one file, as the real one writes three."""

    def save_pretrained(self, folder: str) -> None:
        Path(folder).mkdir(parents=True)
        (Path(folder) / "tokenizer_config.json").write_text('{"mine": true}')


def test_a_cache_that_cannot_be_written_is_skipped(tmp_path: Path) -> None:
    winner = tmp_path / "tokenizers" / "key"
    winner.mkdir(parents=True)
    (winner / "tokenizer_config.json").write_text('{"first": true}')
    tokenizer_module._save_tokenizer(_FolderWriter(), winner)  # a concurrent start got there first
    assert (winner / "tokenizer_config.json").read_text() == '{"first": true}'
    assert [p.name for p in winner.parent.iterdir()] == ["key"]

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    tokenizer_module._save_tokenizer(_FolderWriter(), blocked / "tokenizers" / "key")
    assert blocked.read_text() == ""

    fresh = tmp_path / "fresh" / "key"
    tokenizer_module._save_tokenizer(_FolderWriter(), fresh)
    assert (fresh / "tokenizer_config.json").read_text() == '{"mine": true}'
    assert [p.name for p in fresh.parent.iterdir()] == ["key"]


def test_large_inputs_are_encoded_in_a_lower_priority_worker(smollm2_gguf: Path) -> None:
    """The worker gives the engine the CPU first, and encodes exactly as the tokenizer does."""
    tokenizer = load_tokenizer(smollm2_gguf)
    pool = TokenizerPool(tokenizer)
    text = "émigré naïve 日本語 " * (INLINE_LIMIT // 8)
    spawned_in: list[threading.Thread] = []
    spawn = ProcessPoolExecutor._adjust_process_count  # noqa: SLF001 (where it spawns)

    def recording_spawn(executor: ProcessPoolExecutor) -> None:
        spawned_in.append(threading.current_thread())
        spawn(executor)

    async def encode_on_the_loop() -> tuple[list[int], threading.Thread]:
        return await pool.encode(text), threading.current_thread()

    try:
        with mock.patch.object(ProcessPoolExecutor, "_adjust_process_count", recording_spawn):
            encoded, loop_thread = asyncio.run(encode_on_the_loop())
        assert encoded == tokenizer.encode(text)
        # starting the worker blocks for seconds: never on the event loop's thread
        assert spawned_in and loop_thread not in spawned_in
        workers = list(pool._start()._processes)  # noqa: SLF001 (no public list of workers)
        assert len(workers) == 1
        assert (os.getpriority(os.PRIO_PROCESS, workers[0])
                == os.getpriority(os.PRIO_PROCESS, 0) + WORKER_NICENESS)
    finally:
        pool.shutdown()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values")
def test_the_early_tokenizer_loads_at_a_lower_priority_and_leaves_the_callers_alone():
    """The API server loads its tokenizer while the engine core loads, in a thread of nice
    +10, so that the core's work (a first start's kernel compile) gets the cores first; the
    thread that serves requests afterwards keeps its priority."""
    from pagellm.mistral.formats import ModelFormats
    from pagellm.model import text

    before = os.getpriority(os.PRIO_PROCESS, 0)
    seen: list[int] = []

    def load(spec: object) -> str:
        seen.append(os.getpriority(os.PRIO_PROCESS, 0))
        return "tokenizer"

    with mock.patch.object(text, "load_text_tokenizer", load):
        early = text.load_early_tokenizer(None, None, ModelFormats())
    assert early is not None and early.tokenizer == "tokenizer"
    assert seen == [min(before + 10, 19)]
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
