"""The shipped manifests pass the offline validators, and each validator refuses a broken copy
(a typo, a bad enum, a rule KServe's webhook enforces, a flag pagellm rejects)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest

from deploy.validate.pagellm_args import container_argv, parse_serve_args
from deploy_utils import DEPLOY, assert_rejected, find, load, validator

MANIFESTS = sorted([*(DEPLOY / "kubernetes").glob("*.yaml"), *(DEPLOY / "kserve").glob("*.yaml")])
KSERVE = DEPLOY / "kserve"
RUNTIMES = [*load(KSERVE / "pagellm-runtime.yaml"),
            *load(KSERVE / "pagellm-multinode-runtime.yaml"),
            *load(KSERVE / "pagellm-multinode-mp-runtime.yaml")]


def all_manifests() -> list[dict]:
    return [document for path in MANIFESTS for document in load(path)]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid(path: Path) -> None:
    # the runtime comes along so an InferenceService's args are checked merged into it
    documents = load(path) + RUNTIMES
    assert validator().errors(documents) == []


def _pagellm_container(documents: list[dict], kind: str = "Deployment") -> dict:
    return find(documents, kind)["spec"]["template"]["spec"]["containers"][0]


def _typo_in_service(docs: list[dict]) -> None:
    find(docs, "Service")["spec"]["selectr"] = {"app": "mistral"}


def _typo_in_worker_spec(docs: list[dict]) -> None:
    find(docs, "InferenceService")["spec"]["predictor"]["workerSpec"] = {
        "pipelineParallelSize": 2, "tensorParalelSize": 1}


def _bad_router_type(docs: list[dict]) -> None:
    find(docs, "InferenceGraph")["spec"]["nodes"]["root"]["routerType"] = "Pipeline"


def _bad_dependency(docs: list[dict]) -> None:
    find(docs, "InferenceGraph")["spec"]["nodes"]["root"]["steps"][0]["dependency"] = "Mandatory"


def _no_root_node(docs: list[dict]) -> None:
    nodes = find(docs, "InferenceGraph")["spec"]["nodes"]
    nodes["rag"] = nodes.pop("root")


def _two_targets(docs: list[dict]) -> None:
    find(docs, "InferenceGraph")["spec"]["nodes"]["root"]["steps"][0]["nodeName"] = "root"


def _splitter_weights(docs: list[dict]) -> None:
    root = find(docs, "InferenceGraph")["spec"]["nodes"]["root"]
    root["routerType"] = "Splitter"
    for step, weight in zip(root["steps"], (90, 20)):
        step["weight"] = weight


def _unknown_flag(docs: list[dict]) -> None:
    _pagellm_container(docs)["args"] += ["--max-model-length", "4096"]  # vLLM says --max-model-len


def _data_parallel(docs: list[dict]) -> None:
    # data parallel engines with their ranks spread over nodes: not built
    _pagellm_container(docs)["args"] += ["--data-parallel-size", "2", "--nnodes", "2"]


def _hub_model_id(docs: list[dict]) -> None:
    _pagellm_container(docs)["args"][0] = "mistralai/Mistral-7B-Instruct-v0.3"


def _probe_on_wrong_port(docs: list[dict]) -> None:
    _pagellm_container(docs)["livenessProbe"]["httpGet"]["port"] = 8080


def _probe_on_wrong_path(docs: list[dict]) -> None:
    _pagellm_container(docs)["readinessProbe"]["httpGet"]["path"] = "/healthz"


def _isvc_bad_arg(docs: list[dict]) -> None:
    find(docs, "InferenceService")["spec"]["predictor"]["model"]["args"] += ["--max-model-len",
                                                                            "lots"]


def _isvc_multinode(docs: list[dict]) -> None:
    find(docs, "InferenceService")["spec"]["predictor"]["workerSpec"] = {
        "pipelineParallelSize": 2, "tensorParallelSize": 1}


def _bad_metadata_name(docs: list[dict]) -> None:
    find(docs, "InferenceGraph")["metadata"]["name"] = "RAG_graph"


BREAKAGES: dict[str, tuple[str, Callable[[list[dict]], None], str]] = {
    "core typo": ("kubernetes/pagellm-gpu.yaml", _typo_in_service, "'selectr' was unexpected"),
    "kserve typo": ("kserve/inferenceservice.yaml", _typo_in_worker_spec,
                    "'tensorParalelSize' was unexpected"),
    "router type": ("kserve/inferencegraph-rag.yaml", _bad_router_type, "'Pipeline' is not one of"),
    "dependency": ("kserve/inferencegraph-rag.yaml", _bad_dependency, "'Mandatory' is not one of"),
    "root node": ("kserve/inferencegraph-rag.yaml", _no_root_node, "root node not found"),
    "two targets": ("kserve/inferencegraph-rag.yaml", _two_targets, "more than one of nodeName"),
    "splitter": ("kserve/inferencegraph-rag.yaml", _splitter_weights, "should be 100"),
    "graph name": ("kserve/inferencegraph-rag.yaml", _bad_metadata_name, "must match"),
    "unknown flag": ("kubernetes/pagellm-gpu.yaml", _unknown_flag,
                     "unrecognized arguments: --max-model-length 4096"),
    "data parallel": ("kubernetes/pagellm-gpu.yaml", _data_parallel,
                      "data parallelism combined with --nnodes"),
    "hub model id": ("kubernetes/pagellm-gpu.yaml", _hub_model_id, "is under no volume mount"),
    "probe port": ("kubernetes/pagellm-gpu.yaml", _probe_on_wrong_port,
                   "livenessProbe asks port 8080, pagellm listens on 8000"),
    "probe path": ("kubernetes/pagellm-gpu.yaml", _probe_on_wrong_path,
                   "readinessProbe path must be /health"),
    "isvc arg": ("kserve/inferenceservice.yaml", _isvc_bad_arg, "invalid int value: 'lots'"),
    "isvc multi-node": ("kserve/inferenceservice.yaml", _isvc_multinode,
                        "runs pagellm on one node: a workerSpec needs a multi-node runtime"),
}


@pytest.mark.parametrize("name", BREAKAGES)
def test_broken_copy_is_rejected(name: str) -> None:
    relative, breaker, expected = BREAKAGES[name]
    assert_rejected(load(DEPLOY / relative) + load(KSERVE / "pagellm-runtime.yaml"), breaker,
                    expected)


SEED_ISVC = {
    "apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
    "metadata": {"name": "huggingface-llama3",
                 "annotations": {"serving.kserve.io/deploymentMode": "Standard",
                                 "serving.kserve.io/autoscalerClass": "none"}},
    "spec": {"predictor": {"model": {"modelFormat": {"name": "huggingface"},
                                     "storageUri": "pvc://llama-3-8b-pvc/hf/8b_instruction_tuned"},
                           "workerSpec": {"pipelineParallelSize": 2, "tensorParallelSize": 1}}},
}


def test_seed_multinode_service_passes_kserve_rules() -> None:
    """The seed's own multi-node InferenceService (KServe's runtime) meets KServe's rules."""
    assert validator().errors([SEED_ISVC]) == []


@pytest.mark.parametrize("change, expected", [
    (lambda s: s["metadata"]["annotations"].pop("serving.kserve.io/autoscalerClass"),
     "autoscalerClass: none"),
    (lambda s: s["spec"]["predictor"]["model"].update(storageUri="s3://bucket/llama"),
     "must be pvc:// or oci://"),
    (lambda s: s["spec"]["predictor"]["model"].update(
        env=[{"name": "TENSOR_PARALLEL_SIZE", "value": "2"}]), "env TENSOR_PARALLEL_SIZE"),
    (lambda s: s["spec"]["predictor"]["workerSpec"].update(
        containers=[{"name": "a"}, {"name": "b"}]), "at most one worker container"),
    (lambda s: s["metadata"]["annotations"].update(
        {"serving.kserve.io/deploymentMode": "Serverless"}), "deploymentMode: Standard"),
])
def test_multinode_webhook_rules(change: Callable[[dict], object], expected: str) -> None:
    service = copy.deepcopy(SEED_ISVC)
    change(service)
    errors = validator().errors([service])
    assert any(expected in error for error in errors), errors


def test_unknown_kind_is_an_error() -> None:
    scaled = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
              "metadata": {"name": "x"}, "spec": {}}
    assert any("no schema" in error for error in validator().errors([scaled]))


def test_service_monitor_typo_is_rejected() -> None:
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
               "metadata": {"name": "m"},
               "spec": {"selector": {"matchLabels": {"app": "x"}},
                        "endpoints": [{"port": "http", "intervall": "15s"}]}}
    assert any("'intervall' was unexpected" in e for e in validator().errors([monitor]))


def test_argv_is_what_the_entrypoint_runs() -> None:
    """Without `command` the image runs `pagellm serve --host 0.0.0.0 ARGS`; $(VAR) expands
    from the container's env as the kubelet expands it."""
    container = {"args": ["--port", "$(PORT)", "--served-model-name", "{{.Name}}"],
                 "env": [{"name": "PORT", "value": "9000"}]}
    namespace, error = parse_serve_args(container_argv(container, template_name="llama3"))
    assert error == ""
    assert (namespace.host, namespace.port, namespace.served_model_name) == (
        "0.0.0.0", 9000, ["llama3"])


def test_every_shipped_container_parses() -> None:
    """Each pagellm container of the shipped manifests, through pagellm's own parser."""
    containers = [c for d in all_manifests() if d["kind"] == "Deployment"
                  for c in d["spec"]["template"]["spec"]["containers"]]
    assert len(containers) == 2
    for container in containers:
        namespace, error = parse_serve_args(container_argv(container))
        assert error == "" and namespace.verb == "serve", error
