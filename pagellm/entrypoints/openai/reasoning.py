"""`--reasoning-parser`: the model's thinking, split from its answer.

Like the tool parsers, a reasoning parser is a pure function of the text so far, so the
streamed `reasoning` and `content` deltas add up to the non-streamed message for any chunking.
"""

from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.json_calls import split_at_marker

_START, _END = "<think>", "</think>"


class ReasoningParser:
    """Qwen3: thinking is what a leading `<think>` opens, up to `</think>` (or the end, if
    the budget ran out); an answer that does not start with `<think>` has none."""

    starts_inside = False  # DeepSeek-R1's template writes the `<think>` into the prompt

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) settled in `text`."""
        body = text.lstrip()
        if body.startswith(_START):
            body = body[len(_START):]
        elif not final and body and _START.startswith(body):
            return "", ""  # may still become `<think>`
        elif not self.starts_inside:
            return "", text
        reasoning, end = split_at_marker(body, _END, final)
        if end is None:
            return reasoning, ""
        return reasoning, body[end:].lstrip("\n")


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and QwQ): everything up to `</think>` is thinking, `<think>` or not."""

    starts_inside = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser,
}


def reasoning_parser(name: str | None) -> type[ReasoningParser] | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(sorted(REASONING_PARSERS))}.")
    return REASONING_PARSERS[name]
