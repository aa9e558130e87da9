"""Question in, chunks out, and the chat-completions body with those chunks inserted.

The context goes into the conversation's system message (merged into the first one
if the request has one, so templates that allow a single system turn still work);
the user's messages are passed on unchanged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from pagellm.rag.embedder import Embedder
from pagellm.rag.store import Hit, VectorStore

CONTEXT_INSTRUCTIONS = ("Answer the question using the context below when it is relevant. "
                        "Each excerpt starts with its place in the documentation.")


@dataclass
class Retriever:
    """A question longer than the embedding model's limit is cut there for retrieval (the
    LLM still gets all of it)."""

    store: VectorStore
    embedder: Embedder
    collection: str
    top_k: int = 4

    def retrieve(self, query: str, top_k: int | None = None) -> list[Hit]:
        vector = self.embedder.embed([query], truncate=True)[0]
        return self.store.query(self.collection, vector, top_k or self.top_k)

    async def aretrieve(self, query: str, top_k: int | None = None) -> list[Hit]:
        vector = (await self.embedder.aembed([query], truncate=True))[0]
        return self.store.query(self.collection, vector, top_k or self.top_k)


def message_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content
                         if isinstance(part, dict) and part.get("type") == "text")
    return ""


def question_of(body: dict[str, Any]) -> str:
    """The last user message of a chat-completions body: what to retrieve for."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("the body has no messages: expected a chat-completions request.")
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            text = message_text(message.get("content")).strip()
            if text:
                return text
    raise ValueError("the conversation has no user message with text to retrieve for.")


def format_context(hits: list[Hit]) -> str:
    parts = [f"[{number}] {hit.breadcrumb} ({hit.source})\n{hit.text}"
             for number, hit in enumerate(hits, 1)]
    return CONTEXT_INSTRUCTIONS + "\n\n" + "\n\n".join(parts)


def with_context(body: dict[str, Any], hits: list[Hit]) -> dict[str, Any]:
    """A copy of `body` whose system message carries the retrieved chunks."""
    out = copy.deepcopy(body)
    if not hits:
        return out
    context = format_context(hits)
    messages = out["messages"]
    if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
        first = message_text(messages[0].get("content"))
        messages[0] = {**messages[0], "content": f"{first}\n\n{context}" if first else context}
    else:
        messages.insert(0, {"role": "system", "content": context})
    return out


def sources_of(hits: list[Hit]) -> list[dict[str, Any]]:
    """What an answer says it was built from."""
    return [{"id": hit.id, "score": round(hit.score, 6), "breadcrumb": hit.breadcrumb,
             "source": hit.source} for hit in hits]
