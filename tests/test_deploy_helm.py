"""The Helm chart as the real `helm` renders it: lint, template with each values file, every
rendered manifest through the offline validators, and values pagellm cannot honour refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deploy.validate.pagellm_args import container_argv, parse_serve_args
from deploy_utils import CHART, CI_VALUES, find, helm, render, validator

VALUES_SETS = {"default": [], **{p.stem: ["-f", str(p)] for p in CI_VALUES},
               "namespaced-runtime": ["-f", str(CHART / "ci" / "kserve-values.yaml"),
                                      "--set", "kserve.runtime.clusterScoped=false"]}


@pytest.mark.parametrize("name", VALUES_SETS)
def test_lint_and_rendered_manifests_validate(name: str) -> None:
    helm("lint", "--strict", str(CHART), *VALUES_SETS[name])
    documents = render(*VALUES_SETS[name])
    assert documents
    assert validator().errors(documents) == []


def test_values_sets_cover_every_kind() -> None:
    checker = validator()
    router_types = set()
    for args in VALUES_SETS.values():
        documents = render(*args)
        checker.errors(documents)
        router_types |= {node["routerType"] for d in documents if d["kind"] == "InferenceGraph"
                         for node in d["spec"]["nodes"].values()}
    assert checker.seen_kinds == {
        "Deployment", "Service", "PersistentVolumeClaim", "Secret", "HorizontalPodAutoscaler",
        "ServiceMonitor", "ServingRuntime", "ClusterServingRuntime", "InferenceService",
        "InferenceGraph", "RayCluster"}
    assert router_types == {"Sequence", "Switch", "Ensemble", "Splitter"}


def _engine_namespace(documents: list[dict]):
    container = find(documents, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    namespace, error = parse_serve_args(container_argv(container))
    assert error == "", error
    return namespace


def test_production_stack_keys_become_engine_flags() -> None:
    path = CHART / "ci" / "gpu-values.yaml"
    model = yaml.safe_load(path.read_text())["servingEngineSpec"]["modelSpec"][0]
    config = model["vllmConfig"]
    namespace = _engine_namespace(render("-f", str(path)))
    assert namespace.model == model["modelURL"]
    assert namespace.served_model_name == [model["name"]]
    assert namespace.max_model_len == config["maxModelLen"]
    assert namespace.gpu_memory_utilization == config["gpuMemoryUtilization"]
    assert namespace.dtype == config["dtype"]
    assert namespace.enable_prefix_caching is config["enablePrefixCaching"]
    assert namespace.kv_offloading_size == float(model["lmcacheConfig"]["cpuOffloadingBufferSize"])


def test_gpu_values_request_the_gpu_and_mount_the_model() -> None:
    documents = render("-f", str(CHART / "ci" / "gpu-values.yaml"))
    pod = find(documents, "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["runtimeClassName"] == "nvidia"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/data", "/dev/shm"}
    claim = find(documents, "PersistentVolumeClaim")
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    key = container["env"][0]
    assert key["name"] == "PAGELLM_API_KEY"
    assert key["valueFrom"]["secretKeyRef"] == {"name": "pagellm-api-key", "key": "token"}


def test_prefix_caching_off_renders_the_negative_flag() -> None:
    namespace = _engine_namespace(render(
        "--set", "servingEngineSpec.modelSpec[0].name=m",
        "--set", "servingEngineSpec.modelSpec[0].repository=pagellm",
        "--set", "servingEngineSpec.modelSpec[0].tag=cpu",
        "--set", "servingEngineSpec.modelSpec[0].vllmConfig.enablePrefixCaching=false"))
    assert namespace.enable_prefix_caching is False


@pytest.mark.parametrize("override, expected", [
    ("servingEngineSpec.modelSpec[0].vllmConfig.tensorParallelSize=0", "minimum: got 0, want 1"),
    # production-stack's raySpec sits in a modelSpec, not beside it
    ("servingEngineSpec.raySpec.enabled=true", "'raySpec' not allowed"),
    ("servingEngineSpec.modelSpec[0].raySpec.enabled=true", "missing property 'headNode'"),
    ("servingEngineSpec.modelSpec[0].raySpec.headNode.requestGpu=1", "'requestGpu' not allowed"),
    ("servingEngineSpec.modelSpec[0].hf_token=x", "'hf_token' not allowed"),
    ("servingEngineSpec.modelSpec[0].modelURL=mistralai/Mistral-7B-v0.3",
     "pagellm never downloads weights"),
    ("routerSpec.enableRouter=true", "'routerSpec' not allowed"),
])
def test_values_pagellm_cannot_honour_are_refused(override: str, expected: str) -> None:
    base = ["-f", str(CHART / "ci" / "gpu-values.yaml")]
    result = helm("template", "test", str(CHART), *base, "--set", override, check=False)
    assert result.returncode != 0
    assert expected in result.stderr, result.stderr


RAY_VALUES = ["-f", str(CHART / "ci" / "ray-values.yaml")]


@pytest.mark.parametrize("override, expected", [
    ("vllmConfig.pipelineParallelSize=1", "needs more than one rank and a multiple of 2"),
    ("replicaCount=2", "2 ranks over the head and 2 workers"),
    ("hpa.enabled=true,servingEngineSpec.modelSpec[0].hpa.maxReplicas=3",
     "a raySpec model runs on a RayCluster"),
])
def test_ray_layouts_pagellm_cannot_run_are_refused(override: str, expected: str) -> None:
    result = helm("template", "test", str(CHART), *RAY_VALUES,
                  "--set", f"servingEngineSpec.modelSpec[0].{override}", check=False)
    assert result.returncode != 0
    assert expected in result.stderr, result.stderr


def test_ray_spec_renders_a_ray_cluster_whose_head_serves_on_ray() -> None:
    model = yaml.safe_load((CHART / "ci" / "ray-values.yaml").read_text())[
        "servingEngineSpec"]["modelSpec"][0]
    documents = render(*RAY_VALUES)
    assert [d["kind"] for d in documents].count("Deployment") == 0
    cluster = find(documents, "RayCluster")
    head_pod = cluster["spec"]["headGroupSpec"]["template"]
    head = head_pod["spec"]["containers"][0]
    assert head["command"] == ["pagellm-ray-head"]
    namespace, error = parse_serve_args(container_argv(head))
    assert error == "", error
    assert namespace.distributed_executor_backend == "ray"
    assert namespace.pipeline_parallel_size == model["vllmConfig"]["pipelineParallelSize"]
    assert head["resources"]["requests"]["cpu"] == str(model["raySpec"]["headNode"]["requestCPU"])
    env = {e["name"]: e.get("value") for e in head["env"]}
    assert env["RAY_NODE_COUNT"] == str(model["replicaCount"] + 1)
    (group,) = cluster["spec"]["workerGroupSpecs"]
    assert group["replicas"] == model["replicaCount"]
    worker = group["template"]["spec"]["containers"][0]
    assert worker["command"] == ["pagellm-ray-worker",
                                 f"{cluster['metadata']['name']}-head-svc:6379"]
    # the engine Service reaches the head only
    selector = find(documents, "Service")["spec"]["selector"]
    assert selector.items() <= head_pod["metadata"]["labels"].items()
    assert not selector.items() <= group["template"]["metadata"]["labels"].items()


def _ray_head(documents: list[dict]) -> dict:
    return find(documents, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"][
        "containers"][0]


@pytest.mark.parametrize("breaker, expected", [
    (lambda d: find(d, "RayCluster")["spec"].update(workerGroupSpec=[]),
     "'workerGroupSpec' was unexpected"),
    (lambda d: find(d, "RayCluster")["spec"]["workerGroupSpecs"][0]["template"]["spec"][
        "containers"][0].update(volumeMount=[]),
     "spec.workerGroupSpecs.0.template.spec.containers.0: Additional properties"),
    (lambda d: _ray_head(d)["args"].__setitem__(-3, "2"),
     "--tensor-parallel-size 2 differs from workerSpec's 1"),
    (lambda d: find(d, "RayCluster")["spec"]["workerGroupSpecs"][0]["template"]["spec"][
        "containers"][0].update(command=["ray", "start"]), "must run pagellm-ray-worker"),
])
def test_broken_ray_cluster_is_rejected(breaker, expected: str) -> None:
    documents = render(*RAY_VALUES)
    breaker(documents)
    errors = validator().errors(documents)
    assert any(expected in error for error in errors), errors


def test_broken_probe_values_are_caught_after_rendering() -> None:
    """helm renders what the values say; the validator catches a probe on the wrong port."""
    documents = render("--set", "servingEngineSpec.livenessProbe.httpGet.port=9000")
    errors = validator().errors(documents)
    assert any("livenessProbe asks port 9000" in error for error in errors), errors


def test_values_typo_fails_lint() -> None:
    """values.schema.json refuses unknown top-level keys, so a values typo fails `helm lint`."""
    result = helm("lint", str(CHART), "--set", "servingEngineSpc.enableEngine=false",
                  check=False)
    assert result.returncode != 0 and "'servingEngineSpc' not allowed" in result.stdout + \
        result.stderr


def test_chart_packages(tmp_path: Path) -> None:
    """`helm package` accepts the chart (what a chart repository serves)."""
    helm("package", str(CHART), "--destination", str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["pagellm-0.1.0.tgz"]
