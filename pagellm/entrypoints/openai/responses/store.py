"""Finished responses kept for `previous_response_id` and `GET /v1/responses/{id}`.

Bounded (least recently used out first), unlike vLLM's store that never evicts: a server
that answers millions of `store: true` requests (OpenAI's default) keeps a fixed amount.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pagellm.entrypoints.openai.responses.objects import ResponseObject


@dataclass
class StoredResponse:
    response: ResponseObject
    history: list[dict[str, Any]]  # the conversation as chat messages, this answer included


class ResponseStore:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, entry: StoredResponse) -> None:
        if self.max_entries <= 0:
            return
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
