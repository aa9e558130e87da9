"""The multi-node KServe runtime on Ray: its head script's `pagellm serve` line through
pagellm's parser with the env KServe injects, broken copies refused, and the head and worker
scripts run by bash against stand-in `ray` and `pagellm` commands."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from deploy.validate.pagellm_args import container_argv, parallel_env, parse_serve_args
from deploy_utils import DEPLOY, assert_rejected, find, load, validator

RUNTIME = load(DEPLOY / "kserve" / "pagellm-multinode-runtime.yaml")
SERVICE = load(DEPLOY / "kserve" / "inferenceservice-multinode.yaml")


def _head(docs: list[dict]) -> dict:
    return find(docs, "ClusterServingRuntime")["spec"]["containers"][0]


def _worker_spec(docs: list[dict]) -> dict:
    return find(docs, "ClusterServingRuntime")["spec"]["workerSpec"]


def _edit_head_args(old: str, new: str | None) -> Callable[[list[dict]], None]:
    def edit(docs: list[dict]) -> None:
        args = _head(docs)["args"]
        index = args.index(old)
        if new is None:
            del args[index:index + 2]
        else:
            args[index] = new
    return edit


def _worker_runs(docs: list[dict]) -> None:
    _worker_spec(docs)["containers"][0]["command"] = ["ray", "start", "--head"]


def _head_runs(docs: list[dict]) -> None:
    _head(docs)["command"] = ["ray-head"]


def _second_worker_container(docs: list[dict]) -> None:
    containers = _worker_spec(docs)["containers"]
    containers.append({**containers[0], "name": "sidecar"})


def _tensor_parallel_env(docs: list[dict]) -> None:
    find(docs, "InferenceService")["spec"]["predictor"]["model"]["env"] = [
        {"name": "TENSOR_PARALLEL_SIZE", "value": "2"}]


def _bad_service_arg(docs: list[dict]) -> None:
    find(docs, "InferenceService")["spec"]["predictor"]["model"]["args"] += ["--max-num-seqs",
                                                                            "many"]


BREAKAGES: dict[str, tuple[Callable[[list[dict]], None], str]] = {
    "typo in the head's flag": (_edit_head_args("--pipeline-parallel-size", "--pipeline-size"),
                                "unrecognized arguments: --pipeline-size 2"),
    "size hard-coded": (_edit_head_args("$(TENSOR_PARALLEL_SIZE)", "2"),
                        "--tensor-parallel-size 2 differs from workerSpec's 1"),
    "no ray backend": (_edit_head_args("--distributed-executor-backend", None),
                       "needs --distributed-executor-backend ray"),
    "undefined variable": (_edit_head_args("$(PIPELINE_PARALLEL_SIZE)", "$(PIPELINE_SIZE)"),
                           "value: '$(PIPELINE_SIZE)'"),
    "head command": (_head_runs, "command must start with pagellm or pagellm-ray-head"),
    "worker command": (_worker_runs, "must run pagellm-ray-worker"),
    "second worker container": (_second_worker_container, "at most one worker container"),
    "TP set by env": (_tensor_parallel_env, "env TENSOR_PARALLEL_SIZE is not allowed"),
    "service arg": (_bad_service_arg, "invalid int value: 'many'"),
}


def test_runtime_and_service_are_valid() -> None:
    assert validator().errors(RUNTIME + SERVICE) == []


@pytest.mark.parametrize("name", BREAKAGES)
def test_broken_copy_is_rejected(name: str) -> None:
    assert_rejected(RUNTIME + SERVICE, *BREAKAGES[name])


def test_head_serves_the_service_sizes_on_ray() -> None:
    """The service's workerSpec (not the runtime's default) reaches the head's flags, and the
    service's args come after the runtime's."""
    service = find(SERVICE, "InferenceService")["spec"]["predictor"]
    container = {**_head(RUNTIME), "args": [*_head(RUNTIME)["args"], *service["model"]["args"]]}
    injected = parallel_env(_worker_spec(RUNTIME), {"pipelineParallelSize": 3})
    namespace, error = parse_serve_args(container_argv(container, "llama3", injected))
    assert error == "", error
    assert (namespace.tensor_parallel_size, namespace.pipeline_parallel_size) == (1, 3)
    assert namespace.distributed_executor_backend == "ray"
    assert namespace.served_model_name == ["llama3"]
    assert namespace.max_model_len == 8192


STAND_INS = {
    # `ray status` lists as many nodes as RAY_FAKE_NODES says; every call is logged
    "ray": '#!/bin/sh\necho "ray $*" >> "$CALLS"\n[ "$1" = status ] || exit 0\n'
           'i=0; while [ $i -lt "$RAY_FAKE_NODES" ]; do echo " 1 node_$i"; i=$((i+1)); done\n',
    "pagellm": '#!/bin/sh\necho "pagellm $* cpus=$PAGELLM_RAY_CPUS_PER_RANK" >> "$CALLS"\n',
}
HEAD_SCRIPT = DEPLOY / "docker" / "ray-head.sh"
WORKER_SCRIPT = DEPLOY / "docker" / "ray-worker.sh"


def _pod_env(tmp_path: Path, nodes: int, **env: str) -> dict[str, str]:
    """Stand-ins for `ray` and `pagellm` first on PATH, logging their calls to $CALLS."""
    for name, text in STAND_INS.items():
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    return {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
            "CALLS": str(tmp_path / "calls"), "RAY_FAKE_NODES": str(nodes), "NODE_CPUS": "4",
            **env}


def _run_script(script: Path, args: list[str], tmp_path: Path, nodes: int, **env: str):
    result = subprocess.run(["bash", str(script), *args], env=_pod_env(tmp_path, nodes, **env),
                            text=True, capture_output=True, timeout=60)
    calls = (tmp_path / "calls").read_text() if (tmp_path / "calls").exists() else ""
    return result, calls


def test_head_waits_for_the_nodes_then_serves(tmp_path: Path) -> None:
    sizes = {"TENSOR_PARALLEL_SIZE": "2", "PIPELINE_PARALLEL_SIZE": "2", "RAY_NODE_COUNT": "2"}
    container = {**_head(RUNTIME), "args": [*_head(RUNTIME)["args"], "--max-model-len", "8192"]}
    args = container_argv(container, "llama3", sizes)[3:]  # after `serve --host 0.0.0.0`
    result, calls = _run_script(HEAD_SCRIPT, args, tmp_path, nodes=2, **sizes)
    assert result.returncode == 0, result.stderr
    assert calls.splitlines()[0].startswith("ray start --head --port=6379 --num-cpus=4")
    assert "pagellm-ray-head: 2 Ray nodes joined; 4 ranks of 2 CPUs" in result.stdout
    assert calls.splitlines()[-1] == (
        "pagellm serve --host 0.0.0.0 /mnt/models --port 8080 --served-model-name llama3 "
        "--tensor-parallel-size 2 --pipeline-parallel-size 2 --distributed-executor-backend "
        "ray --max-model-len 8192 cpus=2")


def test_head_gives_up_when_the_workers_do_not_join(tmp_path: Path) -> None:
    sizes = {"PIPELINE_PARALLEL_SIZE": "2", "PAGELLM_RAY_WAIT_SECONDS": "0"}
    result, calls = _run_script(HEAD_SCRIPT, ["/mnt/models"], tmp_path, nodes=1, **sizes)
    assert result.returncode == 1
    assert "pagellm-ray-head: only 1 of 2 Ray nodes joined in 0 s" in result.stderr
    assert "pagellm serve" not in calls


def test_head_refuses_ranks_that_do_not_share_out(tmp_path: Path) -> None:
    sizes = {"TENSOR_PARALLEL_SIZE": "3", "RAY_NODE_COUNT": "2"}
    result, calls = _run_script(HEAD_SCRIPT, [], tmp_path, nodes=2, **sizes)
    assert result.returncode == 1
    assert "3 ranks do not share out over 2 nodes of 4 CPUs" in result.stderr
    assert calls == ""


def test_worker_joins_the_head_service(tmp_path: Path) -> None:
    """The runtime's worker command, run by bash as the pod runs it."""
    command = _worker_spec(RUNTIME)["containers"][0]["command"]
    script = command[2].replace("pagellm-ray-worker", f"bash {WORKER_SCRIPT}")
    env = _pod_env(tmp_path, nodes=1, HEAD_SVC="llama3-head-1", POD_NAMESPACE="llm")
    result = subprocess.run(["bash", "-c", script], text=True, capture_output=True, timeout=60,
                            env=env)
    assert result.returncode == 0, result.stderr
    head = "llama3-head-1.llm.svc.cluster.local:6379"
    assert (tmp_path / "calls").read_text().splitlines() == [
        f"ray health-check --address={head}",
        f"ray start --address={head} --num-cpus=4 --block"]
