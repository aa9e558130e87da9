"""Multi-node without Ray, as two "nodes" on this machine: `pagellm serve ... --headless
--node-rank 1` runs rank 1 and joins the driver of node 0 at --master-addr/--master-port;
greedy tokens and logits are the single-process engine's, and the headless node exits 0
when the driver stops it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from server_utils import cli_env, free_port
from test_distributed import ENGINE, _check_same, _shutdown

from pagellm import LLM


def test_a_headless_node_serves_the_other_half_of_the_ranks(tiny_llama_dir: Path) -> None:
    port = free_port()
    nodes = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    headless = subprocess.Popen(
        [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", str(tiny_llama_dir), "-tp",
         "2", "--dtype", "float32", *nodes, "--node-rank", "1", "--headless"],
        env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        single = LLM(str(tiny_llama_dir), **ENGINE)
        parallel = LLM(str(tiny_llama_dir), tensor_parallel_size=2, nnodes=2, node_rank=0,
                       master_addr="127.0.0.1", master_port=port, **ENGINE)
        try:
            _check_same(single, parallel)
        finally:
            _shutdown(parallel)
        output, _ = headless.communicate(timeout=60)
        assert headless.returncode == 0, output
        assert "Headless node 1 of 2: ranks 1-1 join the driver at 127.0.0.1:" in output
    finally:
        if headless.poll() is None:
            headless.kill()


@pytest.mark.parametrize("flags, message", [
    ({"nnodes": 2, "node_rank": 1}, "add --headless"),
    ({"nnodes": 2, "headless": True}, "node 0 runs the API server"),
    ({"nnodes": 3}, "does not split evenly over nnodes 3"),
    ({"nnodes": 2, "node_rank": 2, "headless": True}, "must be below nnodes 2"),
    ({"nnodes": 2, "distributed_executor_backend": "ray"}, "use --distributed-executor-backend"),
])
def test_inconsistent_node_layouts_are_one_line(flags: dict, message: str) -> None:
    from pagellm.distributed.config import ParallelArgs

    with pytest.raises(ValueError, match=message):
        ParallelArgs(tensor_parallel_size=2, **flags).parallel_config()
