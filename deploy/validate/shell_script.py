"""The commands of a container that runs a `bash -c` / `sh -c` script.

A multi-node head cannot run `pagellm serve` directly: it starts the Ray head and waits for
the workers first. Its `pagellm serve` line still has to pass pagellm's parser, so it is read
out of the script here: continuation lines joined, words split as the shell splits them,
`$VAR` / `${VAR}` filled in from the environment the pod will have (the container's env and
what KServe injects), and `"$@"` from the words after the script (`bash -c SCRIPT NAME ARGS`:
KServe appends the InferenceService's args there). A variable the environment does not
define is an error, never a guess.
"""

from __future__ import annotations

import re
import shlex
from pathlib import PurePosixPath

SHELLS = ("bash", "sh")
_REFERENCE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


class ScriptError(ValueError):
    """The script's command cannot be read without running it."""


def shell_script(words: list[str]) -> tuple[str, list[str]] | None:
    """(script, its "$@") when `words` (command + args) run a shell script, else None."""
    if len(words) >= 3 and PurePosixPath(words[0]).name in SHELLS and words[1] == "-c":
        return words[2], words[4:]  # words[3] is the script's $0
    return None


def find_command(script: str, program: tuple[str, ...]) -> list[str] | None:
    """The words of the first line that runs `program` (e.g. ("pagellm", "serve")), with a
    leading `exec` dropped and quotes removed, variables not yet expanded."""
    for line in script.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        if words[:1] == ["exec"]:
            words = words[1:]
        if tuple(words[:len(program)]) == program:
            return words
    return None


def expand(words: list[str], env: dict[str, str], positional: list[str]) -> list[str]:
    """`words` with "$@" and $VAR / ${VAR} replaced as the shell would replace them."""
    expanded = []
    for word in words:
        if word == "$@":
            expanded += positional
            continue
        missing = [m[1] or m[2] for m in _REFERENCE.finditer(word) if (m[1] or m[2]) not in env]
        if missing:
            raise ScriptError(f"${missing[0]} in {word!r} is set neither by the container's "
                              "env nor by KServe")
        expanded.append(_REFERENCE.sub(lambda m: env[m[1] or m[2]], word))
    return expanded
