"""One choice's generated text, split into reasoning, content and tool calls as it grows.

Streamed and non-streamed answers go through the same object (a non-streamed one is fed
its whole text at once), so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.entrypoints.openai.response_models import (DeltaFunctionCall, DeltaToolCall,
                                                        FunctionCall, ToolCall)
from pagellm.entrypoints.openai.reasoning import ReasoningParser
from pagellm.entrypoints.openai.tool_parsers.core import ToolCallStreamer, ToolParser


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


class ChoiceOutput:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None,
                 max_calls: int | None) -> None:
        self.reasoning_parser = reasoning
        self.streamer = ToolCallStreamer(tools, max_calls) if tools is not None else None
        self.text = ""
        self.reasoning = ""
        self.content = ""  # the answer text (without reasoning), before tool-call parsing
        self.sent_content = ""
        self.calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]

    def feed(self, delta: str, final: bool) -> ChoiceDelta:
        self.text += delta
        reasoning, content = (self.reasoning_parser.split(self.text, final)
                              if self.reasoning_parser is not None else ("", self.text))
        out = ChoiceDelta(reasoning=reasoning[len(self.reasoning):])
        growth = content[len(self.content):]
        self.reasoning, self.content = reasoning, content
        if self.streamer is None:
            out.content = growth
        else:
            streamed = self.streamer.feed(growth, final)
            out.content = streamed.content
            out.tool_calls = [self._delta(call) for call in streamed.tool_calls]
        self.sent_content += out.content
        return out

    def _delta(self, call) -> DeltaToolCall:
        if call.id is not None:
            self.calls[call.index] = [call.id, call.name, call.arguments]
            return DeltaToolCall(index=call.index, id=call.id, type="function",
                                 function=DeltaFunctionCall(name=call.name,
                                                            arguments=call.arguments))
        self.calls[call.index][2] += call.arguments
        return DeltaToolCall(index=call.index, function=DeltaFunctionCall(arguments=call.arguments))

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))
                for call_id, name, arguments in (self.calls[i] for i in sorted(self.calls))]
