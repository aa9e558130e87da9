"""A response built step by step, as the typed events of a Responses stream.

Each engine step's delta (reasoning, message text, tool-call fragments; see `ChoiceOutput`)
opens, grows and closes output items, in OpenAI's order: `output_item.added`, then for a
message `content_part.added` and `output_text.delta`s, then the matching `.done` events.
A non-streamed answer runs the same builder and keeps only the final object, so streamed
and non-streamed answers cannot disagree.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pagellm.entrypoints.openai.chat_output import ChoiceDelta
from pagellm.entrypoints.openai.response_models import DeltaToolCall
from pagellm.entrypoints.openai.responses.objects import (FunctionCallOutput, IncompleteDetails,
                                                          MessageOutput, OutputItem, OutputText,
                                                          ReasoningOutput, ReasoningPart,
                                                          ResponseError, ResponseObject,
                                                          ResponseUsage, TokenLogprob)

Event = dict[str, Any]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.sequence_number = 0
        self.open: OutputItem | None = None
        self.calls: dict[int, FunctionCallOutput] = {}  # tool-call index -> its item

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def _snapshot(self) -> dict[str, Any]:
        return self.response.model_dump(mode="json")

    def start(self) -> list[Event]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def feed(self, delta: ChoiceDelta, logprobs: list[TokenLogprob]) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning:
            item = self._ensure_open(ReasoningOutput, events)
            item.content[0].text += delta.reasoning
            events.append(self._event("response.reasoning_text.delta", **self._where(item),
                                      content_index=0, delta=delta.reasoning))
        if delta.content:
            item = self._ensure_open(MessageOutput, events)
            item.content[0].text += delta.content
            item.content[0].logprobs += logprobs
            events.append(self._event("response.output_text.delta", **self._where(item),
                                      content_index=0, delta=delta.content,
                                      logprobs=[entry.model_dump() for entry in logprobs]))
        for call in delta.tool_calls:
            events += self._feed_call(call)
        return events

    def _feed_call(self, call: DeltaToolCall) -> list[Event]:
        events: list[Event] = []
        if call.id is not None:
            events += self._close("completed")
            item = FunctionCallOutput(id=_item_id("fc"), call_id=call.id,
                                      name=call.function.name or "")
            self.calls[call.index] = item
            events += self._add(item)
        item = self.calls[call.index]
        if call.function.arguments:
            item.arguments += call.function.arguments
            events.append(self._event("response.function_call_arguments.delta",
                                      **self._where(item), delta=call.function.arguments))
        return events

    def _where(self, item: OutputItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self.response.output.index(item)}

    def _ensure_open(self, kind: type, events: list[Event]) -> Any:
        if isinstance(self.open, kind):
            return self.open
        events += self._close("completed")
        if kind is MessageOutput:
            item: OutputItem = MessageOutput(id=_item_id("msg"), content=[OutputText()])
        else:
            item = ReasoningOutput(id=_item_id("rs"), content=[ReasoningPart()])
        events += self._add(item)
        return item

    def _add(self, item: OutputItem) -> list[Event]:
        self.response.output.append(item)
        self.open = item
        shown = item.model_copy(deep=True)
        if isinstance(shown, (MessageOutput, ReasoningOutput)):
            shown.content = []
        events = [self._event("response.output_item.added", output_index=len(
            self.response.output) - 1, item=shown.model_dump(mode="json"))]
        if isinstance(item, MessageOutput):
            events.append(self._event("response.content_part.added", **self._where(item),
                                      content_index=0,
                                      part=OutputText().model_dump(mode="json")))
        return events

    def _close(self, status: str) -> list[Event]:
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        where = self._where(item)
        events = []
        if isinstance(item, MessageOutput):
            part = item.content[0]
            events += [self._event("response.output_text.done", **where, content_index=0,
                                   text=part.text,
                                   logprobs=[entry.model_dump() for entry in part.logprobs]),
                       self._event("response.content_part.done", **where, content_index=0,
                                   part=part.model_dump(mode="json"))]
        elif isinstance(item, ReasoningOutput):
            events.append(self._event("response.reasoning_text.done", **where, content_index=0,
                                      text=item.content[0].text))
        else:
            events.append(self._event("response.function_call_arguments.done", **where,
                                      name=item.name, arguments=item.arguments))
        events.append(self._event("response.output_item.done", output_index=where[
            "output_index"], item=item.model_dump(mode="json")))
        return events

    def finish(self, finish_reason: str | None, usage: ResponseUsage) -> list[Event]:
        """`length` makes the response (and its last item) incomplete, as OpenAI does."""
        incomplete = finish_reason == "length"
        events: list[Event] = []
        if not self.response.output:  # an empty answer is still one (empty) message
            self._ensure_open(MessageOutput, events)
        events += self._close("incomplete" if incomplete else "completed")
        self.response.usage = usage
        self.response.completed_at = int(time.time())
        if incomplete:
            self.response.status = "incomplete"
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            return events + [self._event("response.incomplete", response=self._snapshot())]
        self.response.status = "completed"
        return events + [self._event("response.completed", response=self._snapshot())]

    def fail(self, message: str) -> list[Event]:
        """The terminal event of a stream that broke: the response with its error."""
        if self.open is not None:
            self.open.status = "incomplete"
            self.open = None
        self.response.status = "failed"
        self.response.error = ResponseError(code="server_error", message=message)
        return [self._event("response.failed", response=self._snapshot())]
