"""Model files that cannot be used: one line that names the file and the problem.

`pagellm serve` prints it as its only error line and exits with code 2, instead of a
traceback with the cause buried in it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

_MAX_PROBLEM_CHARS = 300


class ModelLoadError(ValueError):
    """`<file>: <problem>`; picklable, so it can cross from the engine core process."""


def model_file_error(path: Path, problem: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: {problem}")


def _one_line(error: BaseException) -> str:
    if isinstance(error, KeyError):
        return f"lacks the key {error.args[0]!r}" if error.args else "lacks a key"
    text = " ".join(str(error).split()) or type(error).__name__
    if len(text) > _MAX_PROBLEM_CHARS:
        text = text[:_MAX_PROBLEM_CHARS] + "..."
    return text


@contextlib.contextmanager
def reading(path: Path, what: str) -> Iterator[None]:
    """Any error while reading `path` becomes one ModelLoadError: `path: what (cause)`."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as error:
        raise model_file_error(path, f"{what}: {_one_line(error)}") from None
