"""The pieces of benchmarks/router_replicas.py: the multi-turn chat workload and its driver,
and the script itself against fake replicas (its plumbing, not its figures)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import pytest
from fake_openai_server import FakeOpenAIServer, WordTokenizer
from server_utils import REPO_ROOT, cli_env

from pagellm.benchmarks.multi_turn import (ChatWorkload, build_conversations,
                                           run_conversations, turn_messages)
from pagellm.benchmarks.serve_client import Endpoint

WORKLOAD = ChatWorkload(system_prompts=3, system_len=50, conversations=7, turns=3,
                        user_len=6, reply_len=2, seed=1)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAIServer]:
    server = FakeOpenAIServer()
    server.start()
    yield server
    server.stop()


def test_conversations_share_long_system_prompts() -> None:
    tokenizer = WordTokenizer()
    conversations = build_conversations(WORKLOAD, tokenizer)
    systems = [conversation.system for conversation in conversations]
    assert len(set(systems)) == 3
    assert systems[0] == systems[3] == systems[6] != systems[1]
    assert all(len(tokenizer.encode(system)) == 50 for system in systems)
    users = [user for conversation in conversations for user in conversation.users]
    assert len(set(users)) == len(users) == 21
    salted = build_conversations(ChatWorkload(**{**WORKLOAD.__dict__, "salt": "Run 1. "}),
                                 tokenizer)
    assert all(s.system.startswith("Run 1. ") for s in salted)
    assert not {s.system for s in salted} & set(systems)


def test_each_turn_extends_the_previous_turns_request() -> None:
    conversation = build_conversations(WORKLOAD, WordTokenizer())[0]
    first = turn_messages(conversation, [])
    second = turn_messages(conversation, ["a reply"])
    assert second[:len(first)] == first
    assert second[len(first):] == [{"role": "assistant", "content": "a reply"},
                                   {"role": "user", "content": conversation.users[1]}]


def test_driver_sends_each_history_with_the_servers_replies(fake: FakeOpenAIServer) -> None:
    fake.reset(chunk_delay_s=0.0)
    conversations = build_conversations(WORKLOAD, WordTokenizer())
    endpoint = Endpoint(f"{fake.url}/v1/chat/completions", "openai-chat", "fake-model",
                        ignore_eos=True)
    run = asyncio.run(run_conversations(endpoint, conversations, clients=2))
    assert len(run.outputs) == 21 and all(output.success for output in run.outputs)
    assert fake.state.peak <= 2
    by_first_user: dict[str, list[list[dict[str, str]]]] = {}
    for body in fake.state.bodies:
        by_first_user.setdefault(body["messages"][1]["content"], []).append(body["messages"])
    assert len(by_first_user) == 7   # one per conversation
    for turns in by_first_user.values():
        assert [len(messages) for messages in turns] == [2, 4, 6]
        for earlier, later in zip(turns, turns[1:]):
            assert later[:len(earlier)] == earlier
            assert later[len(earlier)] == {"role": "assistant", "content": " tok tok"}


def test_script_reports_every_setup_against_fake_replicas() -> None:
    command = [sys.executable, "benchmarks/router_replicas.py", "--fake-replicas",
               "--clients", "2", "--prompts-per-client", "1", "--input-len", "8",
               "--output-len", "2", "--policies", "prefix", "--chat-policies", "round_robin",
               "--system-prompts", "2", "--system-len", "20", "--conversations", "2",
               "--turns", "2", "--user-len", "4", "--reply-len", "2", "--chat-clients", "2"]
    done = subprocess.run(command, cwd=REPO_ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| ")]
    labels = [row[0].removeprefix("| ") for row in rows]
    assert labels == ["setup", "---", "2 x 1-core replicas, router prefix",
                      "1 x 2-thread replica, direct", "routing", "---", "round_robin"]
    assert rows[2][6] == rows[3][6] == "0"   # no request failed
    chat_row = rows[-1]
    assert chat_row[1] == "n/a"   # the fakes have no prefix cache
    assert chat_row[5] == "2 / 2" and chat_row[6] == "0"   # answers per replica, failed
    assert "Machine: " in done.stdout and "Command: `python benchmarks/router_replicas.py" \
        in done.stdout
