"""Prompt logprobs through the server, with the official `openai` SDK: legacy completions'
`echo` with `logprobs` (what lm-eval's loglikelihood tasks send, `max_tokens: 0` included)
and vLLM's `prompt_logprobs` on completions and chat, streamed and not. The server splits
prompts into chunks of 7 tokens and caches prefixes, as a loaded server would."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from server_utils import RemoteServer, assert_clean_shutdown

PROMPT = "Once upon a time there was a small village by the river, where people baked bread"
MESSAGES = [{"role": "user", "content": "Tell me a story about a robot."}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[RemoteServer]:
    remote = RemoteServer(tiny_llama_dir, "--served-model-name", "tiny",
                          "--max-num-batched-tokens", "7")
    yield remote
    assert_clean_shutdown(remote.stop())


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def prompt_ids(server: RemoteServer) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]


@pytest.fixture(scope="module")
def teacher_forced(tiny_llama_dir: Path, prompt_ids: list[int]) -> list[float]:
    """transformers' float32 logprob of each prompt token after the first."""
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logprobs = ref(torch.tensor([prompt_ids])).logits[0, :-1].float().log_softmax(-1)
    return logprobs.gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0].tolist()


def assert_scored_prompt(logprobs, prompt_ids: list[int], expected: list[float],
                         num_top: int) -> None:
    """The prompt's part of an echo's logprobs: null first, then the model's logprobs."""
    count = len(prompt_ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:count] == pytest.approx(expected, abs=1e-4)
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset[:count] == sorted(logprobs.text_offset[:count])
    for token, logprob, top in zip(logprobs.tokens[1:count], logprobs.token_logprobs[1:count],
                                   logprobs.top_logprobs[1:count]):
        assert top[token] == logprob and len(top) <= num_top + 1
        assert max(top.values()) >= logprob


def test_echo_with_max_tokens_0_scores_the_prompt(client: openai.OpenAI, prompt_ids: list[int],
                                                   teacher_forced: list[float]) -> None:
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True,
                                         logprobs=1, temperature=0)
    choice = response.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(prompt_ids)
    assert_scored_prompt(choice.logprobs, prompt_ids, teacher_forced, 1)
    assert response.usage.completion_tokens == 0
    assert response.usage.prompt_tokens == len(prompt_ids)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True)
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None
    assert plain.usage.completion_tokens == 0


def test_echo_puts_the_prompt_before_the_completion(client: openai.OpenAI,
                                                    prompt_ids: list[int],
                                                    teacher_forced: list[float]) -> None:
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=5, logprobs=2, temperature=0,
                  extra_body={"ignore_eos": True})
    generated = client.completions.create(**kwargs).choices[0]
    echoed = client.completions.create(echo=True, **kwargs).choices[0]
    assert echoed.text == PROMPT + generated.text
    count = len(prompt_ids)
    assert_scored_prompt(echoed.logprobs, prompt_ids, teacher_forced, 2)
    assert echoed.logprobs.tokens[count:] == generated.logprobs.tokens
    # within rounding: the second request starts from the first one's cached prefix, and
    # the tiny float32 model is not batch-invariant
    assert echoed.logprobs.token_logprobs[count:] == pytest.approx(
        generated.logprobs.token_logprobs, abs=1e-5)
    assert [top.keys() for top in echoed.logprobs.top_logprobs[count:]] == [
        top.keys() for top in generated.logprobs.top_logprobs]
    assert echoed.logprobs.text_offset[count:] == [len(PROMPT) + offset for offset
                                                   in generated.logprobs.text_offset]
    assert echoed.model_extra["prompt_logprobs"][0] is None  # echo asks for them (vLLM)


def test_streamed_echo_equals_the_whole_answer(client: openai.OpenAI,
                                               prompt_ids: list[int]) -> None:
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=4, logprobs=1, echo=True,
                  temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)
              if c.choices]
    assert chunks[0].text.startswith(PROMPT)
    assert len(chunks[0].logprobs.tokens) > len(prompt_ids)
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset


def test_streamed_scoring_sends_the_prompt_alone(client: openai.OpenAI,
                                                 prompt_ids: list[int],
                                                 teacher_forced: list[float]) -> None:
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0,
                                            echo=True, logprobs=0, stream=True,
                                            stream_options={"include_usage": True}))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in choices) == PROMPT
    assert choices[-1].finish_reason == "length"
    assert_scored_prompt(choices[0].logprobs, prompt_ids, teacher_forced, 0)
    assert len(choices[0].logprobs.tokens) == len(prompt_ids)
    assert chunks[-1].usage.completion_tokens == 0


def check_prompt_logprobs(entries: list, prompt_ids: list[int], expected: list[float],
                          num_top: int) -> None:
    """vLLM's shape: null, then {token id: {logprob, rank, decoded_token}} per prompt token."""
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for token_id, entry, logprob in zip(prompt_ids[1:], entries[1:], expected):
        chosen = entry[str(token_id)]
        assert chosen["logprob"] == pytest.approx(logprob, abs=1e-4)
        assert chosen["rank"] >= 1 and isinstance(chosen["decoded_token"], str)
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:num_top] == list(range(1, num_top + 1)) and len(entry) <= num_top + 1


def test_completion_prompt_logprobs(client: openai.OpenAI, prompt_ids: list[int],
                                    teacher_forced: list[float]) -> None:
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3,
                                         temperature=0, extra_body={"prompt_logprobs": 3})
    choice = response.choices[0]
    check_prompt_logprobs(choice.model_extra["prompt_logprobs"], prompt_ids, teacher_forced, 3)
    assert choice.logprobs is None and response.usage.completion_tokens == 3


def test_chat_prompt_logprobs_whole_and_streamed(client: openai.OpenAI,
                                                 server: RemoteServer) -> None:
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0,
                  extra_body={"prompt_logprobs": 2})
    response = client.chat.completions.create(**kwargs)
    entries = response.model_extra["prompt_logprobs"]
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert len(entries) == response.usage.prompt_tokens == len(ids)
    assert entries[0] is None and all(str(t) in e for t, e in zip(ids[1:], entries[1:]))
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    carrying = [c for c in chunks if c.model_extra.get("prompt_logprobs") is not None]
    assert len(carrying) == 1 and carrying[0].model_extra["prompt_logprobs"] == entries
    assert chunks.index(carrying[0]) <= 1  # the first chunk after the role's


@pytest.mark.parametrize("fields, extra", [
    ({}, {"prompt_logprobs": -1}),
    ({}, {"prompt_logprobs": 21}),  # past the server's 20, as the sampled tokens' logprobs
    ({"logprobs": 21, "echo": True}, {}),
    ({"max_tokens": 0}, {}),  # without echo there is nothing to return
])
def test_bad_prompt_logprobs_requests_are_400s(client: openai.OpenAI, fields: dict,
                                               extra: dict) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt=PROMPT, **{"max_tokens": 2, **fields},
                                  extra_body=extra)
    assert error.value.status_code == 400
