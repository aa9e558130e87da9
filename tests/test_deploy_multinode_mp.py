"""The multi-node KServe runtime without Ray (`multinode/executor-backend: mp`): its head and
worker command lines through pagellm's parser with the env KServe injects, and broken copies
refused, by KServe's webhook rules and by pagellm's own checks of how the pods find each
other."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from deploy.validate.pagellm_args import container_argv, parallel_env, parse_serve_args
from deploy_utils import DEPLOY, assert_rejected, find, load, validator

RUNTIME = load(DEPLOY / "kserve" / "pagellm-multinode-mp-runtime.yaml")
SERVICE = load(DEPLOY / "kserve" / "inferenceservice-multinode-mp.yaml")


def _spec(docs: list[dict]) -> dict:
    return find(docs, "ClusterServingRuntime")["spec"]


def _head(docs: list[dict]) -> dict:
    return _spec(docs)["containers"][0]


def _worker(docs: list[dict]) -> dict:
    return _spec(docs)["workerSpec"]["containers"][0]


def _edit(part: Callable[[list[dict]], dict], key: str, old: str,
          new: list[str]) -> Callable[[list[dict]], None]:
    """Replace the word `old` of the container's `key` list by `new` (nothing: delete it)."""
    def edit(docs: list[dict]) -> None:
        words = part(docs)[key]
        index = words.index(old)
        words[index:index + 1] = new
    return edit


def _annotation(docs: list[dict]) -> None:
    _spec(docs)["annotations"]["multinode/executor-backend"] = "mpp"


def _probe_port(docs: list[dict]) -> None:
    command = _worker(docs)["livenessProbe"]["exec"]["command"]
    command[-1] = command[-1].replace("/29501", "/6379")


def _pipeline_env(docs: list[dict]) -> None:
    find(docs, "InferenceService")["spec"]["predictor"]["model"]["env"] = [
        {"name": "PIPELINE_PARALLEL_SIZE", "value": "2"}]


def _s3_storage(docs: list[dict]) -> None:
    find(docs, "InferenceService")["spec"]["predictor"]["model"]["storageUri"] = "s3://b/m"


def _second_worker(docs: list[dict]) -> None:
    containers = _spec(docs)["workerSpec"]["containers"]
    containers.append({**containers[0], "name": "sidecar"})


_HEAD_ARGS = (_head, "args")
_WORKER_COMMAND = (_worker, "command")
BREAKAGES: dict[str, tuple[Callable[[list[dict]], None], str]] = {
    "annotation typo": (_annotation, "multinode/executor-backend must be ray or mp, got 'mpp'"),
    "head nodes hard-coded": (
        _edit(*_HEAD_ARGS, "--node-rank", ["--nnodes", "1", "--node-rank"]),
        "--nnodes 1 differs from the node count of KServe's mp mode (the pipeline size, 2)"),
    "head on loopback": (_edit(*_HEAD_ARGS, "$(POD_IP)", ["127.0.0.1"]),
                         "--master-addr 127.0.0.1 must be this pod's IP"),
    "head on ray": (_edit(*_HEAD_ARGS, "--node-rank", ["--distributed-executor-backend", "ray",
                                                       "--node-rank"]),
                    "--nnodes runs the mp executor"),
    "worker rank": (_edit(*_WORKER_COMMAND, "--headless", ["--headless", "--node-rank", "1"]),
                    "--node-rank 1 would be every worker pod's"),
    "worker serves": (_edit(*_WORKER_COMMAND, "--headless", []),
                      "must run `pagellm serve ... --headless`"),
    "worker port": (_edit(*_WORKER_COMMAND, "29501", ["29600"]),
                    "--master-port 29600 differs from the head's 29501"),
    "worker address": (_edit(*_WORKER_COMMAND,
                             "$(HEAD_SVC).$(POD_NAMESPACE).svc.cluster.local", ["$(POD_IP)"]),
                       "must name the head's Service"),
    "worker typo": (_edit(*_WORKER_COMMAND, "--nnodes", ["--nodes"]),
                    "unrecognized arguments: --nodes 2"),
    "probe port": (_probe_port, "the livenessProbe must check the head's master port"),
    "PP set by env": (_pipeline_env, "env PIPELINE_PARALLEL_SIZE is not allowed"),
    "storage": (_s3_storage, "multi-node storageUri must be pvc:// or oci://"),
    "second worker container": (_second_worker, "at most one worker container"),
}


def test_runtime_and_service_are_valid() -> None:
    assert validator().errors(RUNTIME + SERVICE) == []


@pytest.mark.parametrize("name", BREAKAGES)
def test_broken_copy_is_rejected(name: str) -> None:
    assert_rejected(RUNTIME + SERVICE, *BREAKAGES[name])


def test_head_and_workers_run_the_service_sizes() -> None:
    """The service's workerSpec reaches both command lines: one node per pipeline stage, the
    head node 0 on its pod IP, the workers headless with no rank, at the head's Service."""
    service = find(SERVICE, "InferenceService")["spec"]["predictor"]
    injected = parallel_env(_spec(RUNTIME)["workerSpec"], {"pipelineParallelSize": 3})
    head = {**_head(RUNTIME), "args": [*_head(RUNTIME)["args"], *service["model"]["args"]]}
    namespace, error = parse_serve_args(container_argv(head, "llama3", injected))
    assert error == "", error
    assert (namespace.pipeline_parallel_size, namespace.nnodes, namespace.node_rank,
            namespace.headless, namespace.master_addr, namespace.master_port,
            namespace.max_model_len) == (3, 3, 0, False, "$(POD_IP)", 29501, 8192)
    worker_env = {**injected, "HEAD_SVC": "llama3-head-1"}
    namespace, error = parse_serve_args(container_argv(_worker(RUNTIME), "llama3", worker_env))
    assert error == "", error
    assert (namespace.pipeline_parallel_size, namespace.nnodes, namespace.node_rank,
            namespace.headless, namespace.master_addr, namespace.master_port) == (
        3, 3, None, True, "llama3-head-1.$(POD_NAMESPACE).svc.cluster.local", 29501)
