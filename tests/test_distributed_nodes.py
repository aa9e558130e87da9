"""Multi-node without Ray, as "nodes" on this machine: `pagellm serve ... --headless
--node-rank 1` runs rank 1 and joins the driver of node 0 at --master-addr/--master-port;
headless nodes without --node-rank are numbered by the driver in the order they join, and
one too many is refused with a line naming it. Greedy tokens and logits are the
single-process engine's, and a headless node exits 0 when the driver stops it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from server_utils import cli_env, free_port
from test_distributed import ENGINE, _check_same, _shutdown

from pagellm import LLM
from pagellm.distributed.config import ParallelArgs
from pagellm.distributed.roster import HEAD_NODE_ID, NodeRefused, NodeRoster, RankClaim


def _headless(model: Path, port: int, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", str(model), "--dtype",
         "float32", "--master-addr", "127.0.0.1", "--master-port", str(port), "--headless",
         *flags], env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_headless_node_serves_the_other_half_of_the_ranks(tiny_llama_dir: Path) -> None:
    """--node-rank 1 given; a node beyond --nnodes, started late, is refused and exits 1."""
    port = free_port()
    sizes = ("-tp", "2", "--nnodes", "2")
    headless = _headless(tiny_llama_dir, port, *sizes, "--node-rank", "1")
    try:
        single = LLM(str(tiny_llama_dir), **ENGINE)
        parallel = LLM(str(tiny_llama_dir), tensor_parallel_size=2, nnodes=2, node_rank=0,
                       master_addr="127.0.0.1", master_port=port, **ENGINE)
        try:
            _check_same(single, parallel)
            extra = _headless(tiny_llama_dir, port, *sizes)
            output, _ = extra.communicate(timeout=60)
            assert extra.returncode == 1, output
            assert re.search(r"node \S+-[0-9a-f]{4} is refused: all 2 nodes of --nnodes 2 "
                             r"have joined", output), output
        finally:
            _shutdown(parallel)
        output, _ = headless.communicate(timeout=60)
        assert headless.returncode == 0, output
        assert "Headless node 1 of 2: ranks 1-1 join the driver at 127.0.0.1:" in output
    finally:
        if headless.poll() is None:
            headless.kill()


def test_headless_nodes_without_a_rank_are_numbered_as_they_join(tiny_llama_dir: Path) -> None:
    """Four nodes of one rank each (tensor 2 x pipeline 2): the three headless ones, started
    alike, get node ranks 1, 2 and 3 from the driver, in the order they join."""
    port, sizes = free_port(), ("-tp", "2", "-pp", "2", "--nnodes", "4")
    nodes = [_headless(tiny_llama_dir, port, *sizes) for _ in range(3)]
    try:
        single = LLM(str(tiny_llama_dir), **ENGINE)
        parallel = LLM(str(tiny_llama_dir), tensor_parallel_size=2, pipeline_parallel_size=2,
                       nnodes=4, master_addr="127.0.0.1", master_port=port, **ENGINE)
        try:
            _check_same(single, parallel)
        finally:
            _shutdown(parallel)
        outputs = [node.communicate(timeout=60)[0] for node in nodes]
        assert [node.returncode for node in nodes] == [0, 0, 0], outputs
        given = sorted(re.search(r"Rank 0 of node \S+ is global rank (\d) \(node (\d)\)",
                                 output).groups() for output in outputs)
        assert given == [("1", "1"), ("2", "2"), ("3", "3")]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()


def _roster(tp: int = 2, pp: int = 3) -> NodeRoster:
    return NodeRoster(ParallelArgs(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                   nnodes=pp).parallel_config())


def _claim(node_id: str, index: int, node_rank: int | None = None,
           layout: tuple[int, int, int] = (2, 3, 3)) -> RankClaim:
    return RankClaim(node_id, node_rank, index, layout)


def _join(roster: NodeRoster, claim: RankClaim) -> int:
    rank = roster.admit(claim)
    roster.conns[rank] = None  # type: ignore[assignment]  # (no socket here)
    return rank


def test_the_roster_numbers_nodes_in_join_order_and_says_who_is_missing() -> None:
    """Two ranks a node: a node's ranks follow its first, whichever index connects first."""
    roster = _roster()
    assert _join(roster, _claim(HEAD_NODE_ID, 1, 0)) == 1
    assert _join(roster, _claim("pod-b", 1)) == 3  # pod-b is node 1
    assert roster.progress() == ("1 of 3 nodes joined; node 1 (pod-b) has 1 of 2 ranks; "
                                 "missing node rank(s) 2")
    assert _join(roster, _claim("pod-a", 0)) == 4  # pod-a is node 2
    assert _join(roster, _claim("pod-b", 0)) == 2
    assert _join(roster, _claim("pod-a", 1)) == 5
    assert roster.complete and roster.progress() == "3 of 3 nodes joined"


def test_the_roster_refuses_what_does_not_fit_with_one_line() -> None:
    roster = _roster()
    _join(roster, _claim("pod-x", 0, node_rank=1))
    _join(roster, _claim("pod-a", 0))
    refusals = {
        "extra": (_claim("pod-c", 0), "node pod-c is refused: all 3 nodes of --nnodes 3 have "
                                      "joined"),
        "same rank": (_claim("pod-y", 0, node_rank=1), "node pod-y is refused: node rank 1 is "
                      "already held by node pod-x; give each headless node its own "
                      "--node-rank, or none"),
        "sizes": (_claim("pod-z", 0, layout=(2, 2, 3)), "node pod-z was started with -tp 2 -pp 2 "
                  "--nnodes 3, the head with -tp 2 -pp 3 --nnodes 3: start every node with the "
                  "same sizes"),
        "twice": (_claim("pod-a", 0), "rank 4 of node pod-a connected twice"),
    }
    for claim, message in refusals.values():
        with pytest.raises(NodeRefused) as refused:
            roster.admit(claim)
        assert str(refused.value) == message
    with pytest.raises(NodeRefused, match="node pod-c is refused"):  # its other ranks too
        roster.admit(_claim("pod-c", 1))
    assert _join(roster, _claim("pod-a", 1)) == 5  # the refusals took nothing


@pytest.mark.parametrize("flags, message", [
    ({"nnodes": 2, "node_rank": 1}, "add --headless"),
    ({"nnodes": 2, "node_rank": 0, "headless": True}, "node 0 runs the API server"),
    ({"nnodes": 3}, "does not split evenly over nnodes 3"),
    ({"nnodes": 2, "node_rank": 2, "headless": True}, "must be below nnodes 2"),
    ({"nnodes": 2, "distributed_executor_backend": "ray"}, "use --distributed-executor-backend"),
])
def test_inconsistent_node_layouts_are_one_line(flags: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelArgs(tensor_parallel_size=2, **flags).parallel_config()


def test_a_headless_node_without_a_rank_is_assigned_one() -> None:
    config = ParallelArgs(tensor_parallel_size=2, nnodes=2, headless=True).parallel_config()
    assert (config.node_rank, config.layout) == (None, (2, 1, 2))
