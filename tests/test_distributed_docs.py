"""The launch recipes of docs/distributed.md, as written: every `pagellm serve` command in
the page's console blocks (its environment variables included) parses, and its parallel
layout is one pagellm builds, so that the page never shows a command the server refuses.
Starting each layout is the job of the distributed tests; no process is started here."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pagellm.engine.arg_utils import EngineArgs
from pagellm.entrypoints.cli import build_parser

_PAGE = Path(__file__).resolve().parents[1] / "docs" / "distributed.md"
_BLOCK = re.compile(r"^\s*```(?:console|bash)\n(.*?)^\s*```", re.MULTILINE | re.DOTALL)
_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def _commands(page: str) -> list[str]:
    """Each command of the page's console blocks: continuation lines joined, comments cut."""
    commands = []
    for block in _BLOCK.findall(page):
        text = re.sub(r"\\\n\s*", " ", block)
        for line in text.splitlines():
            command = line.split("#", 1)[0].strip()
            if command:
                commands.append(command)
    return commands


def _serve_commands() -> list[str]:
    return [command for command in _commands(_PAGE.read_text())
            if "pagellm serve" in command]


def test_the_page_has_recipes_of_every_kind() -> None:
    flags = " ".join(_serve_commands())
    for flag in ("-tp", "-pp", "-dp", "-dpl", "-dpr", "-dpa", "--headless", "--nnodes",
                 "--distributed-executor-backend ray", "--api-server-count"):
        assert f"{flag} " in flags, f"docs/distributed.md shows no recipe with {flag}"


@pytest.mark.parametrize("command", _serve_commands())
def test_each_recipe_parses_into_a_built_layout(command: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    words = shlex.split(command)
    while _ASSIGNMENT.match(words[0]):
        name, value = words.pop(0).split("=", 1)
        monkeypatch.setenv(name, value)
    assert words[:2] == ["pagellm", "serve"], command
    args = EngineArgs.from_cli_args(build_parser().parse_args(words[1:]))
    parallel = args.parallel_config()  # raises with the refusal's one line if not built
    assert parallel.world_size == args.tensor_parallel_size * args.pipeline_parallel_size
