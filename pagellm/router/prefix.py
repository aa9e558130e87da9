"""Which replica holds which prompt prefix, in the engine's own block hashes.

A prompt's tokens (from a replica's `/tokenize`, so the chat template is the replica's)
are cut into full blocks of the replicas' block size and hashed with the engine's chained
`hash_block` (parent hash, token ids, the request's `cache_salt`): the router's view
of a prefix names exactly the blocks the replica's prefix cache holds. Each replica has an
LRU of the chains sent to it, of about its KV cache's capacity, so prefixes the replica
must have evicted stop attracting requests.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import httpx

from pagellm.core.kv_cache_manager import hash_block


def block_hashes(token_ids: list[int], block_size: int, salt: str | None) -> list[bytes]:
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[start:start + block_size], salt))
    return hashes


class PrefixIndex:
    """Per-replica LRU sets of block hashes."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._held: dict[str, OrderedDict[bytes, None]] = {}

    def matched_blocks(self, backend: str, hashes: list[bytes]) -> int:
        """How many leading blocks of the chain the replica holds (its cache hit, in blocks)."""
        held = self._held.get(backend)
        if held is None:
            return 0
        count = 0
        for block_hash in hashes:
            if block_hash not in held:
                break
            count += 1
        return count

    def record(self, backend: str, hashes: list[bytes]) -> None:
        """The replica now holds the chain: newest use last, oldest evicted past capacity."""
        held = self._held.setdefault(backend, OrderedDict())
        for block_hash in hashes:
            held[block_hash] = None
            held.move_to_end(block_hash)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def forget(self, backend: str) -> None:
        """A replica that was ejected may have restarted with an empty cache."""
        self._held.pop(backend, None)


def tokenize_body(body: dict[str, Any], model: str) -> dict[str, Any] | None:
    """The `/tokenize` request that gives a generation request's prompt tokens, if any."""
    if isinstance(body.get("messages"), list):
        tokenize: dict[str, Any] = {"model": model, "messages": body["messages"]}
        if "chat_template_kwargs" in body:
            tokenize["chat_template_kwargs"] = body["chat_template_kwargs"]
        return tokenize
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return {"model": model, "prompt": prompt}
    return None


async def prompt_tokens(client: httpx.AsyncClient, root: str, body: dict[str, Any],
                        model: str, timeout: float) -> list[int] | None:
    """The prompt's token ids, as the replica at `root` would see them."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    request = tokenize_body(body, model)
    if request is None:
        return None
    response = await client.post(f"{root}/tokenize", json=request, timeout=timeout)
    response.raise_for_status()
    return list(response.json()["tokens"])
