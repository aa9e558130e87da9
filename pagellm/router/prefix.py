"""The router's side of prefix-aware balancing: a request's prompt tokens, through the
replica's own `/tokenize` so that the chat template is the replica's. The hashing and the
per-replica index are the engine's (`pagellm.core.prefix_index`)."""

from __future__ import annotations

from typing import Any

import httpx


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
