"""docs/rag.md runs as written: its `bash` blocks, in order, in one shell (on free ports
instead of the doc's fixed ones), from indexing to an answer with its sources."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.rag_utils import minilm_path
from tests.server_utils import REPO_ROOT, cli_env, free_port

DOC = REPO_ROOT / "docs" / "rag.md"
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```", DOC.read_text(), re.S | re.M)
PORTS = ("8001", "8002", "8080", "8100")


def test_doc_marks_every_block() -> None:
    assert {language for language, _ in BLOCKS} <= {"bash", "console", "yaml"}


def test_doc_commands_answer_a_question_with_sources(tmp_path: Path) -> None:
    minilm_path()  # skips without the embedding model
    script = "\n".join(code for language, code in BLOCKS if language == "bash")
    for port in PORTS:
        script = re.sub(rf"\b{port}\b", str(free_port()), script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "pagellm"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m pagellm.entrypoints.cli "$@"\n')
    shim.chmod(0o755)
    (tmp_path / "docs").symlink_to(REPO_ROOT / "docs")
    env = {**cli_env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PAGELLM_CACHE_DIR": os.environ.get("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))}
    guarded = "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + script
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", guarded], capture_output=True,
                            text=True, env=env, cwd=tmp_path, timeout=600)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in tmp_path.glob("*.log"))
    assert result.returncode == 0, result.stdout + result.stderr + logs
    out = result.stdout
    assert "Ingested 2 file(s) into 'pagellm-docs'" in out
    assert "1. score 0." in out and "Getting started > Memory  (docs/getting-started.md)" in out
    assert "[384, 384]" in out
    assert '"relevance_score"' in out
    assert re.search(r"^0\.\d+ Getting started > Memory docs/getting-started.md$", out, re.M)
    assert "no KV cache is allocated" in (tmp_path / "embeddings.log").read_text()
