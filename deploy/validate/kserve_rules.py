"""The rules KServe's admission webhooks enforce beyond the CRD schemas, re-stated from
inference_graph_validation.go and inference_service_validation.go (validateMultiNodeVariables)
so a manifest that a cluster would refuse fails here first."""

from __future__ import annotations

import re

_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_TARGETS = ("nodeName", "serviceName", "serviceUrl")
_PARALLEL_ENV = ("TENSOR_PARALLEL_SIZE", "PIPELINE_PARALLEL_SIZE")
_DEPLOYMENT_MODE = "serving.kserve.io/deploymentMode"
_AUTOSCALER_CLASS = "serving.kserve.io/autoscalerClass"
_EXECUTOR_BACKEND = "multinode/executor-backend"
_EXECUTOR_BACKENDS = ("ray", "mp")


def inference_graph_errors(graph: dict) -> list[str]:
    name = graph.get("metadata", {}).get("name", "")
    errors = [] if _NAME.match(name) else [f"name {name!r} must match {_NAME.pattern}"]
    nodes = graph.get("spec", {}).get("nodes", {})
    if "root" not in nodes:
        errors.append("root node not found: spec.nodes needs a node named 'root'")
    for node_name, node in nodes.items():
        errors += _node_errors(node_name, node, nodes)
    return errors


def _node_errors(node_name: str, node: dict, nodes: dict) -> list[str]:
    errors, seen = [], set()
    steps = node.get("steps", [])
    for index, step in enumerate(steps):
        where = f"node {node_name!r} step {step.get('name', index)!r}"
        targets = [key for key in _TARGETS if step.get(key)]
        if not targets:
            errors.append(f"{where} does not specify an inference target")
        elif len(targets) > 1:
            errors.append(f"{where} specifies more than one of nodeName, serviceName, serviceUrl")
        if step.get("nodeName") and step["nodeName"] not in nodes:
            errors.append(f"{where} names node {step['nodeName']!r}, which the graph lacks")
        if step.get("data", "$request") not in ("$request", "$response"):
            errors.append(f"{where}: data must be $request or $response, got {step['data']!r}")
        if "name" in step:
            if step["name"] in seen:
                errors.append(f"{where}: duplicate step name")
            seen.add(step["name"])
    if node.get("routerType") == "Splitter":
        if any("weight" not in step for step in steps):
            errors.append(f"node {node_name!r}: a Splitter step is missing the 'Weight'")
        elif sum(step["weight"] for step in steps) != 100:
            errors.append(f"node {node_name!r}: the sum of traffic weights should be 100")
    return errors


def _parallel_env_errors(containers: list[dict]) -> list[str]:
    return [f"env {env['name']} is not allowed: set workerSpec's "
            "tensorParallelSize/pipelineParallelSize"
            for container in containers for env in container.get("env", [])
            if env.get("name") in _PARALLEL_ENV]


def runtime_multinode_errors(runtime: dict) -> list[str]:
    """The same rules on a multi-node runtime: every InferenceService on it would inherit a
    second worker container or a parallel-size env, and be refused."""
    spec = runtime.get("spec", {})
    worker = spec.get("workerSpec")
    if worker is None:
        return []
    errors = _parallel_env_errors([*spec.get("containers", []), *worker.get("containers", [])])
    if len(worker.get("containers", [])) > 1:
        errors.append("workerSpec: at most one worker container")
    backend = (spec.get("annotations") or {}).get(_EXECUTOR_BACKEND, "ray")
    if backend not in _EXECUTOR_BACKENDS:  # KServe would quietly lay the pods out for Ray
        errors.append(f"spec.annotations {_EXECUTOR_BACKEND} must be ray or mp, got "
                      f"{backend!r}")
    return errors


def multinode_errors(service: dict) -> list[str]:
    """KServe's checks on an InferenceService whose predictor has a workerSpec."""
    predictor = service.get("spec", {}).get("predictor", {})
    worker = predictor.get("workerSpec")
    if worker is None:
        return []
    errors = []
    if len(worker.get("containers", [])) > 1:
        errors.append("workerSpec: at most one worker container")
    model = predictor.get("model", {})
    errors += _parallel_env_errors([model, *predictor.get("containers", []),
                                    *worker.get("containers", [])])
    uri = model.get("storageUri", "")
    if not uri.startswith(("pvc://", "oci://")):
        errors.append(f"multi-node storageUri must be pvc:// or oci://, got {uri!r}")
    for key in ("tensorParallelSize", "pipelineParallelSize"):
        if isinstance(worker.get(key), int) and worker[key] < 1:
            errors.append(f"workerSpec.{key} must be at least 1")
    annotations = service.get("metadata", {}).get("annotations", {})
    if annotations.get(_AUTOSCALER_CLASS) != "none":
        errors.append(f"multi-node needs annotation {_AUTOSCALER_CLASS}: none")
    if annotations.get(_DEPLOYMENT_MODE) not in ("Standard", "RawDeployment"):
        errors.append(f"multi-node needs annotation {_DEPLOYMENT_MODE}: Standard")
    return errors
