"""LoRA through a real server and the openai SDK: --lora-modules, the model field, /v1/models,
runtime loading and unloading within the allowed folders, the errors, the metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from lora_utils import ADAPTER_CONFIGS, edit_adapter_config, peft_greedy, save_peft_adapter
from server_utils import RemoteServer, run_cli
from transformers import AutoTokenizer

PROMPT = [11, 57, 203, 94, 310, 42]
STEPS = 8


@pytest.fixture(scope="module")
def adapter_root(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-allowed")
    for seed, (name, config) in enumerate(ADAPTER_CONFIGS.items()):
        save_peft_adapter(tiny_llama_dir, root / name, seed, **config)
    edit_adapter_config(root / "patterns", root / "dora", use_dora=True)
    edit_adapter_config(root / "patterns", root / "no-match", target_modules=["c_attn"])
    return root


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, adapter_root: Path) -> Iterator[RemoteServer]:
    module = json.dumps({"name": "rs", "path": str(adapter_root / "rslora-regex"),
                         "base_model_name": "tiny-parent"})
    server = RemoteServer(tiny_llama_dir, "--served-model-name", "tiny", "--enable-lora",
                          "--max-loras", "2", "--max-cpu-loras", "2", "--lora-modules",
                          f"every={adapter_root / 'every-projection'}", module,
                          "--lora-allowed-dirs", str(adapter_root),
                          env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    yield server
    server.stop()


def completion_text(client: openai.OpenAI, model: str) -> str:
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=STEPS,
                                       temperature=0.0, extra_body={"ignore_eos": True})
    return result.choices[0].text


def expected_text(model_dir: Path, adapter: Path | None) -> str:
    """peft's greedy answer as text; the server never sends an unfinished UTF-8 sequence."""
    tokens = peft_greedy(model_dir, adapter, PROMPT, STEPS)
    text = AutoTokenizer.from_pretrained(model_dir).decode(tokens, skip_special_tokens=True)
    return text.rstrip("\ufffd")


def post(server: RemoteServer, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=30)


def test_models_lists_each_adapter_with_its_parent(server: RemoteServer,
                                                   adapter_root: Path) -> None:
    cards = {card.id: card for card in server.client().models.list().data}
    assert list(cards)[:3] == ["tiny", "every", "rs"]
    assert cards["tiny"].parent is None
    assert cards["every"].parent == "tiny"
    assert cards["every"].root == str(adapter_root / "every-projection")
    assert cards["rs"].parent == "tiny-parent"


def test_the_model_field_selects_the_adapter(server: RemoteServer, tiny_llama_dir: Path,
                                             adapter_root: Path) -> None:
    client = server.client()
    for model, adapter in (("every", "every-projection"), ("rs", "rslora-regex"),
                           ("tiny", None)):
        text = completion_text(client, model)
        assert text == expected_text(tiny_llama_dir, adapter and adapter_root / adapter), model
    chat = client.chat.completions.create(model="every", max_tokens=4, temperature=0.0,
                                          messages=[{"role": "user", "content": "Hello"}])
    assert chat.model == "every"


def test_runtime_load_use_reload_and_unload(server: RemoteServer, tiny_llama_dir: Path,
                                            adapter_root: Path) -> None:
    client = server.client()
    path = str(adapter_root / "patterns")
    loaded = post(server, "load_lora_adapter", {"lora_name": "late", "lora_path": path})
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'late' added successfully."
    assert "late" in [card.id for card in client.models.list().data]
    assert completion_text(client, "late") == expected_text(tiny_llama_dir, Path(path))
    again = post(server, "load_lora_adapter", {"lora_name": "late", "lora_path": path})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    swapped = str(adapter_root / "every-projection")  # in place: new weights, same name
    inplace = post(server, "load_lora_adapter",
                   {"lora_name": "late", "lora_path": swapped, "load_inplace": True})
    assert inplace.status_code == 200, inplace.text
    assert completion_text(client, "late") == completion_text(client, "every")
    removed = post(server, "unload_lora_adapter", {"lora_name": "late"})
    assert removed.text == "Success: LoRA adapter 'late' removed successfully."
    with pytest.raises(openai.NotFoundError):
        completion_text(client, "late")
    gone = post(server, "unload_lora_adapter", {"lora_name": "late"})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError"
    clash = post(server, "load_lora_adapter", {"lora_name": "tiny", "lora_path": path})
    assert clash.status_code == 400 and "conflicts with a served base model" in clash.text


@pytest.mark.parametrize(("folder", "status", "words"), [
    ("dora", 400, "DoRA"), ("no-match", 400, "match no module"),
    ("missing", 404, "No adapter found"), ("../outside", 400, "--lora-allowed-dirs")])
def test_runtime_load_errors(server: RemoteServer, adapter_root: Path, folder: str, status: int,
                             words: str) -> None:
    response = post(server, "load_lora_adapter",
                    {"lora_name": f"bad-{folder}", "lora_path": str(adapter_root / folder)})
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]
    assert f"bad-{folder}" not in [card.id for card in server.client().models.list().data]


def test_lora_metrics(server: RemoteServer) -> None:
    completion_text(server.client(), "every")
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    info = [line.rpartition(" ") for line in text.splitlines()
            if line.startswith("vllm:lora_requests_info{")]
    labels = {name for name, _, _ in info}  # as vLLM's exposition writes them
    assert ('vllm:lora_requests_info{max_lora="2",running_lora_adapters="every",'
            'waiting_lora_adapters=""}') in labels
    assert all(float(value) > 1.7e9 for _, _, value in info)  # the time of the last update
    counted = [line for line in text.splitlines()
               if line.startswith("pagellm:lora_requests_total{") and 'lora_name="every"' in line]
    assert counted and float(counted[0].rpartition(" ")[2]) >= 1


def test_without_runtime_updating_the_routes_do_not_exist(tiny_llama_dir: Path,
                                                          adapter_root: Path) -> None:
    server = RemoteServer(tiny_llama_dir, "--enable-lora")
    try:
        response = post(server, "load_lora_adapter",
                        {"lora_name": "x", "lora_path": str(adapter_root / "patterns")})
        assert response.status_code == 404
    finally:
        server.stop()


def test_a_bad_lora_module_stops_the_start(tiny_llama_dir: Path, adapter_root: Path) -> None:
    result = run_cli("serve", str(tiny_llama_dir), "--enable-lora", "--dtype", "float32",
                     "--lora-modules", f"d={adapter_root / 'dora'}", "--port", "0")
    assert result.returncode != 0
    assert "DoRA (use_dora) is not supported" in result.stderr
    assert "Loading weights" not in result.stderr  # refused before the engine started
