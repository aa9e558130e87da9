"""Tensor parallelism with Ray placing the ranks: a Ray cluster of two nodes on this machine
(a head and a second raylet, one CPU each, as `ray start --head` and `ray start --address`
make them), the engine's two ranks on different nodes, and the same greedy tokens and
logits as the single-process engine. The cluster lives in a child process
(tests/ray_two_nodes.py), so that Ray's driver state never reaches the other tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from server_utils import cli_env

pytest.importorskip("ray")
TESTS = Path(__file__).parent


def test_ray_spreads_the_ranks_over_both_nodes(tiny_llama_dir: Path) -> None:
    env = cli_env()
    env["PYTHONPATH"] = f"{TESTS}:{env.get('PYTHONPATH', '')}"
    run = subprocess.run([sys.executable, str(TESTS / "ray_two_nodes.py"), str(tiny_llama_dir)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "same tokens and logits; ranks on 2 nodes" in run.stdout
