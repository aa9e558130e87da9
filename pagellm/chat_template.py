"""`--chat-template`, read and checked without the tokenizer's libraries.

`pagellm serve` checks the template before it forks its engine core, and nothing imported
before that fork may import torch (transformers does): jinja2 alone parses it."""

from __future__ import annotations

from pathlib import Path

import jinja2


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file path, or the template itself (vLLM's rule: text containing
    braces or newlines is a template). Syntax errors are reported at start-up."""
    if value is None:
        return None
    if any(char in value for char in "{}\n"):
        template = value
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"--chat-template {value!r} is neither a readable file nor a "
                             "Jinja template.")
        template = path.read_text()
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"--chat-template has a syntax error (line {error.lineno}): "
                         f"{error.message}") from None
    return template
