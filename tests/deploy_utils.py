"""Helpers of the deployment tests: the real `helm` and `hadolint` binaries, charts rendered
by Helm, and the validator of deploy/validate pointed at the shared KServe CRD schemas."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from deploy.validate.documents import DEFAULT_KSERVE_SCHEMAS, Validator, load_documents

REPO_ROOT = Path(__file__).resolve().parent.parent
DEPLOY = REPO_ROOT / "deploy"
CHART = DEPLOY / "helm" / "pagellm"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
SETUP_HINT = "run `bash scripts/setup.sh --test`, which installs it"


def tool(name: str) -> str:
    """The path of a binary the test set-up installs (next to pip's scripts, or on PATH)."""
    beside_python = Path(sysconfig.get_path("scripts")) / name
    found = str(beside_python) if beside_python.is_file() else shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` is not installed: {SETUP_HINT}")
    return found


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stderr}")
    return result


def render(*values_args: str) -> list[dict]:
    """`helm template` of the chart with these -f/--set arguments, as YAML documents."""
    return load_documents([helm("template", "test", str(CHART), *values_args).stdout])


def validator() -> Validator:
    if not DEFAULT_KSERVE_SCHEMAS.is_dir():
        pytest.skip(f"KServe CRD schemas absent: {DEFAULT_KSERVE_SCHEMAS} (CI lays out "
                    "../shared beside the repository)")
    return Validator()


def assert_rejected(documents: list[dict], breaker: Callable[[list[dict]], None],
                    expected: str) -> None:
    """The validator rejects a copy of `documents` that `breaker` edits in place with an error
    containing `expected`."""
    broken = copy.deepcopy(documents)
    breaker(broken)
    errors = validator().errors(broken)
    assert any(expected in error for error in errors), errors


def load(path: Path) -> list[dict]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def find(documents: list[dict], kind: str, name: str | None = None) -> dict:
    matches = [d for d in documents
               if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert matches, f"no {kind} {name or ''} among {[d['kind'] for d in documents]}"
    return matches[0]
