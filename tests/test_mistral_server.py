"""`pagellm serve` on a folder in Mistral's native format, through the `openai` SDK: the seeds'
command (`--tokenizer-mode mistral --config_format mistral --load_format mistral`) and the same
folder detected with no flags; its broken variants fail with one line and exit code 2."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_mistral import build_tiny_hf_mistral, write_native

from pagellm import LLM, SamplingParams
from pagellm.model.errors import ModelLoadError
from pagellm.model.loader import load_model
from server_utils import RemoteServer, assert_clean_shutdown, run_cli

SEEDS_FLAGS = ("--tokenizer-mode", "mistral", "--config_format", "mistral",
               "--load_format", "mistral")
SEEDS_MESSAGES = [{"role": "user", "content": "Bonjour, peux-tu te présenter ?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": CITY}}]


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("native")
    return write_native(build_tiny_hf_mistral(root / "hf"), root / "ministral")


@pytest.fixture(scope="module", params=["seeds-flags", "auto"])
def server(request: pytest.FixtureRequest, native: Path) -> Iterator[RemoteServer]:
    flags = SEEDS_FLAGS if request.param == "seeds-flags" else ()
    remote = RemoteServer(native, "--served-model-name", "ministral", *flags,
                          "--enable-auto-tool-choice", "--tool-call-parser", "mistral")
    yield remote
    assert_clean_shutdown(remote.stop())


def test_seeds_chat_request_equals_offline_chat(server: RemoteServer, native: Path) -> None:
    response = server.client().chat.completions.create(
        model="ministral", messages=SEEDS_MESSAGES, temperature=0.0, max_tokens=12)
    offline = LLM(str(native), dtype="float32", tokenizer_mode="mistral",
                  config_format="mistral", load_format="mistral").chat(
        SEEDS_MESSAGES, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    [completion] = offline[0].outputs
    assert response.choices[0].message.content == completion.text
    assert response.usage.completion_tokens == len(completion.token_ids)
    assert response.usage.prompt_tokens == len(offline[0].prompt_token_ids)


def test_tool_call_round_trip(server: RemoteServer) -> None:
    client = server.client()
    first = client.chat.completions.create(
        model="ministral", messages=SEEDS_MESSAGES, tools=TOOLS, tool_choice="required",
        temperature=0.0, max_tokens=60)
    [call] = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), CITY)
    history = [*SEEDS_MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Soleil, 21 °C"}]
    second = client.chat.completions.create(
        model="ministral", messages=history, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0.0, max_tokens=60)
    # the tool result lengthens the prompt by mistral-common's encoding of call and result
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    [again] = second.choices[0].message.tool_calls
    jsonschema.validate(json.loads(again.function.arguments), CITY)


def test_chat_template_kwargs_are_a_400(server: RemoteServer) -> None:
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        server.client().chat.completions.create(
            model="ministral", messages=SEEDS_MESSAGES, max_tokens=4,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}})


def _edit_params(change: Callable[[dict], None]) -> Callable[[Path], str]:
    def edit(folder: Path) -> str:
        params = json.loads((folder / "params.json").read_text())
        change(params)
        (folder / "params.json").write_text(json.dumps(params))
        return "params.json"
    return edit


def _drop_tensor(folder: Path) -> str:
    tensors = load_file(folder / "consolidated.safetensors")
    del tensors["layers.1.attention.wk.weight"]
    save_file(tensors, folder / "consolidated.safetensors")
    return "consolidated.safetensors"


BROKEN = {
    "missing key": (_edit_params(lambda p: p.pop("n_heads")), "lacks the key 'n_heads'"),
    "moe": (_edit_params(lambda p: p.update(moe={"num_experts": 8})), "the key 'moe'"),
    "yarn key": (_edit_params(lambda p: p.update(yarn={
        "factor": 4.0, "original_max_position_embeddings": 32, "apply_scale": False,
        "gamma": 1.0})), "yarn keys ['gamma'] are not supported"),
    "missing tensor": (_drop_tensor, "missing 1 weight"),
}


def _broken(native: Path, target: Path, breaks: Callable[[Path], str]) -> Path:
    target.mkdir()
    for file in native.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target / breaks(target)


@pytest.mark.parametrize("case", BROKEN)
def test_broken_native_folder_names_file_and_key(case: str, native: Path,
                                                 tmp_path: Path) -> None:
    breaks, problem = BROKEN[case]
    file = _broken(native, tmp_path / "model", breaks)
    with pytest.raises(ModelLoadError, match=f"^{file}: ") as error:
        load_model(str(file.parent), torch.float32, torch.device("cpu"))
    assert problem in str(error.value)


@pytest.mark.parametrize("case", ["moe", "missing tensor"])
def test_serve_broken_native_folder_is_one_line_exit_2(case: str, native: Path,
                                                       tmp_path: Path) -> None:
    breaks, problem = BROKEN[case]
    file = _broken(native, tmp_path / "model", breaks)
    result = run_cli("serve", str(file.parent), "--port", "0", *SEEDS_FLAGS,
                     env={"PAGELLM_LOGGING_LEVEL": "WARNING"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"pagellm: error: {file}: "), result.stderr
    assert problem in result.stderr
