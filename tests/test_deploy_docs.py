"""docs/deployment.md's `bash` blocks run as written (offline: hadolint, helm, the
validator); its `console` blocks need Docker or a cluster and say so."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from deploy_utils import REPO_ROOT, tool
from server_utils import cli_env

DOC = REPO_ROOT / "docs" / "deployment.md"
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```", DOC.read_text(), re.S | re.M)
BASH = [code for language, code in BLOCKS if language == "bash"]


def test_doc_marks_every_command_block() -> None:
    assert {language for language, _ in BLOCKS} <= {"bash", "console", "yaml"}
    assert len(BASH) >= 3


@pytest.mark.parametrize("code", BASH, ids=lambda c: c.split()[0] + "..." + c.split()[1])
def test_bash_block_runs(code: str) -> None:
    tools = os.pathsep.join(str(Path(tool(name)).parent) for name in ("helm", "hadolint"))
    env = {**cli_env(), "PATH": tools + os.pathsep + os.environ["PATH"]}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True,
                            text=True, env=env, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_validator_cli_fails_on_a_broken_manifest(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text((REPO_ROOT / "deploy" / "kubernetes" / "pagellm-cpu.yaml").read_text()
                      .replace("--max-num-seqs", "--max-sequences"))
    result = subprocess.run(["python3", "-m", "deploy.validate", str(broken)],
                            capture_output=True, text=True, env=cli_env(), cwd=REPO_ROOT,
                            timeout=120)
    assert result.returncode == 1
    assert "Deployment/qwen: container 'pagellm'" in result.stdout
    assert "1 problems" in result.stderr
