"""A multi-turn chat workload: users continuing conversations that open with long system prompts.

A few distinct system prompts (hundreds of tokens, as support or agent deployments carry)
are shared by many conversations. Each conversation sends its user turns one after the
other, every request carrying the whole history so far, the model's own earlier replies
included: a turn's prompt starts with the previous turn's prompt and answer, a prefix that
a prefix cache can reuse if the request reaches the replica that holds it. That is what a
prefix-aware router is for, and what this workload measures (with `pagellm bench serve`'s
client: `send_request` and its metrics).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from pagellm.benchmarks.datasets import SampleRequest, TextTokenizer, fit_text
from pagellm.benchmarks.serve import BenchmarkRun
from pagellm.benchmarks.serve_client import Endpoint, RequestOutput, send_request

REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ChatWorkload:
    """How many conversations, of what shape (lengths in tokens)."""

    system_prompts: int = 4
    system_len: int = 700
    conversations: int = 32
    turns: int = 4
    user_len: int = 40
    reply_len: int = 32
    seed: int = 0
    # put in front of every system prompt: a run with another salt shares no cached block
    # with this one, however warm the replicas are
    salt: str = ""

    def __post_init__(self) -> None:
        if min(self.system_prompts, self.system_len, self.conversations, self.turns,
               self.user_len, self.reply_len) < 1:
            raise ValueError("every size of a chat workload must be at least 1")


@dataclass(frozen=True)
class Conversation:
    system: str
    users: tuple[str, ...]   # the user's message of each turn, in order
    reply_len: int


def build_conversations(workload: ChatWorkload,
                        tokenizer: TextTokenizer) -> list[Conversation]:
    """Conversation i opens with system prompt i mod `system_prompts`; users' texts differ."""
    rng = random.Random(workload.seed)
    systems = [fit_text(tokenizer, f"{workload.salt}You are assistant {index} of the team.",
                        workload.system_len, rng)[0]
               for index in range(workload.system_prompts)]
    conversations = []
    for index in range(workload.conversations):
        users = tuple(fit_text(tokenizer, "", workload.user_len, rng)[0]
                      for _ in range(workload.turns))
        conversations.append(Conversation(systems[index % len(systems)], users,
                                          workload.reply_len))
    return conversations


def turn_messages(conversation: Conversation, replies: Sequence[str]) -> list[dict[str, str]]:
    """The request of the turn after `replies`: system prompt, every earlier exchange, and
    the next user message."""
    messages = [{"role": "system", "content": conversation.system}]
    for user, reply in zip(conversation.users, replies):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    messages.append({"role": "user", "content": conversation.users[len(replies)]})
    return messages


async def _converse(client: httpx.AsyncClient, endpoint: Endpoint,
                    conversation: Conversation) -> list[RequestOutput]:
    """Every turn of one conversation, each after the previous answer; stops at a failure
    (the next turn would need its answer)."""
    outputs: list[RequestOutput] = []
    replies: list[str] = []
    for user in conversation.users:
        messages = tuple(turn_messages(conversation, replies))
        sample = SampleRequest(user, 0, conversation.reply_len, messages)
        output = await send_request(client, endpoint, sample)
        outputs.append(output)
        if not output.success:
            break
        replies.append(output.generated_text)
    return outputs


async def run_conversations(endpoint: Endpoint, conversations: Sequence[Conversation],
                            clients: int) -> BenchmarkRun:
    """`clients` users at a time, each taking the next conversation when theirs ends.

    The outputs' `prompt_len` is 0: prompt tokens are counted by the servers (their prefix
    cache queries), not by this client."""
    slots = asyncio.Semaphore(clients)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S),
                                 limits=limits) as client:
        start = time.perf_counter()

        async def one(conversation: Conversation) -> list[RequestOutput]:
            async with slots:
                return await _converse(client, endpoint, conversation)

        results = await asyncio.gather(*(one(c) for c in conversations))
        duration = time.perf_counter() - start
    return BenchmarkRun([output for outputs in results for output in outputs], duration)
