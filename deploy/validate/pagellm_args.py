"""Every container that runs pagellm, parsed by pagellm's own argument parser.

A manifest passes here only if `pagellm serve` would start with the args it renders: the
flags exist and their values parse and pass the engine's checks, the probes ask `/health` on
the port the server listens on, and the model is a path the container can see (pagellm never
downloads weights). The image's entrypoint is `pagellm serve --host 0.0.0.0 "$@"`
(deploy/docker/entrypoint.sh), so a container without `command` gets those words first, and
so does the multi-node head's `pagellm-ray-head` (deploy/docker/ray-head.sh), checked with
the sizes the workerSpec makes KServe inject. A runtime annotated `multinode/executor-backend:
mp` runs pagellm's own multi-node mode instead: the head `--nnodes` (the pipeline size, as
KServe counts nodes in that mode) `--node-rank 0 --master-addr` its pod IP, each worker the
same sizes `--headless` at the head's service, with no `--node-rank` (a Deployment's pods
have no index: the head numbers the nodes as they join).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re

from pagellm.entrypoints.cli import build_parser
from pagellm.engine.arg_utils import EngineArgs

ENTRYPOINT = ("serve", "--host", "0.0.0.0")
# the multi-node images' scripts (deploy/docker/ray-*.sh): the head ends in the same words
ENTRYPOINTS = {"pagellm-ray-head": ENTRYPOINT}
WORKER_COMMAND = "pagellm-ray-worker"
EXECUTOR_BACKEND_ANNOTATION = "multinode/executor-backend"  # on the runtime's spec; ray if unset
HEAD_SERVICE_VARIABLE = "HEAD_SVC"  # what KServe names the head's (headless) Service in a worker
_SIZE_ENV = ("TENSOR_PARALLEL_SIZE", "PIPELINE_PARALLEL_SIZE")
HEALTH_PATH = "/health"
KSERVE_MODEL_DIR = "/mnt/models"  # where KServe's storage initializer puts storageUri
_PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
_VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_POD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet")
_RUNTIME_KINDS = ("ServingRuntime", "ClusterServingRuntime")


def is_pagellm_image(image: str) -> bool:
    repository = image.split("@")[0].rsplit("/", 1)[-1].split(":")[0]
    return repository.startswith("pagellm")


def parse_serve_args(argv: list[str]) -> tuple[argparse.Namespace | None, str]:
    """pagellm's CLI on `argv` (after `pagellm`): (namespace, "") or (None, its error)."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            namespace = build_parser().parse_args(argv)
    except SystemExit:
        return None, stderr.getvalue().strip().splitlines()[-1]
    if namespace.verb != "serve":
        return namespace, ""
    engine_args = EngineArgs.from_cli_args(namespace)
    try:
        engine_args.model_config()
        engine_args.scheduler_config()
        engine_args.parallel_config()
    except ValueError as error:
        return None, f"pagellm: error: {error}"
    return namespace, ""


def container_argv(container: dict, template_name: str = "model",
                   injected: dict[str, str] | None = None) -> list[str]:
    """The words after `pagellm` the container runs, with $(VAR) expanded as the kubelet
    does (from its env and `injected`, what KServe adds) and KServe's `{{.Name}}` filled in.
    Raises ValueError for a command that does not run pagellm."""
    env = {item["name"]: item["value"] for item in container.get("env", []) if "value" in item}
    env.update(injected or {})
    words = [*container.get("command", []), *container.get("args", [])]
    words = [_VARIABLE.sub(lambda m: env.get(m[1], m[0]), word).replace("{{.Name}}",
                                                                         template_name)
             for word in words]
    if not container.get("command"):
        return [*ENTRYPOINT, *words]
    if words[0] in ENTRYPOINTS:
        return [*ENTRYPOINTS[words[0]], *words[1:]]
    if words[0] != "pagellm":
        raise ValueError(f"command must start with pagellm or {' or '.join(ENTRYPOINTS)}, "
                         f"got {words[0]!r}")
    return words[1:]


def container_errors(container: dict, mounts: tuple[str, ...] = (),
                     injected: dict[str, str] | None = None, backend: str = "ray") -> list[str]:
    where = f"container {container.get('name')!r}"
    namespace, errors = _container_namespace(where, container, injected)
    if namespace is None:
        return errors
    if namespace.verb != "serve":
        return []
    errors = _probe_errors(container, namespace.port) + _multinode_errors(
        where, namespace, injected or {}, container, backend)
    visible = mounts + tuple(m["mountPath"] for m in container.get("volumeMounts", []))
    if namespace.model and not any(namespace.model.startswith(path) for path in visible):
        errors.append(f"{where}: model {namespace.model!r} is under no volume mount "
                      "(pagellm loads local files only)")
    return errors


def _container_namespace(where: str, container: dict, injected: dict[str, str] | None
                         ) -> tuple[argparse.Namespace | None, list[str]]:
    """The container's command line as pagellm's parser reads it, or why it cannot be read."""
    try:
        argv = container_argv(container, injected=injected)
    except ValueError as error:
        return None, [f"{where}: {error}"]
    namespace, error = parse_serve_args(argv)
    if namespace is None:
        return None, [f"{where}: {error} (args: {' '.join(argv)})"]
    return namespace, []


def _multinode_errors(where: str, namespace: argparse.Namespace, injected: dict[str, str],
                      container: dict, backend: str) -> list[str]:
    """A head must run the sizes the workerSpec gives, with its ranks on Ray or, on an mp
    runtime, over pagellm's own nodes."""
    if not injected:
        return []
    errors = _size_errors(where, namespace, injected)
    if backend == "mp":
        return errors + _mp_head_errors(where, namespace, injected, container)
    world = int(injected["TENSOR_PARALLEL_SIZE"]) * int(injected["PIPELINE_PARALLEL_SIZE"])
    if world > 1 and namespace.distributed_executor_backend != "ray":
        errors.append(f"{where}: the workerSpec spreads {world} ranks over nodes, which "
                      "needs --distributed-executor-backend ray")
    return errors


def _size_errors(where: str, namespace: argparse.Namespace,
                 injected: dict[str, str]) -> list[str]:
    return [f"{where}: --{flag.replace('_', '-')} {getattr(namespace, flag)} differs from "
            f"workerSpec's {injected[variable]}: pass ${variable}"
            for flag, variable in (("tensor_parallel_size", "TENSOR_PARALLEL_SIZE"),
                                   ("pipeline_parallel_size", "PIPELINE_PARALLEL_SIZE"))
            if str(getattr(namespace, flag)) != injected[variable]]


def _mp_node_errors(where: str, namespace: argparse.Namespace,
                    injected: dict[str, str]) -> list[str]:
    """What head and workers share on an mp runtime: one node per pipeline stage (pagellm's
    own checks refuse another executor with --nnodes)."""
    pipeline = injected["PIPELINE_PARALLEL_SIZE"]
    if str(namespace.nnodes) == pipeline:
        return []
    return [f"{where}: --nnodes {namespace.nnodes} differs from the node count of KServe's mp "
            f"mode (the pipeline size, {pipeline}): pass $(PIPELINE_PARALLEL_SIZE)"]


def _mp_head_errors(where: str, namespace: argparse.Namespace, injected: dict[str, str],
                    container: dict) -> list[str]:
    errors = _mp_node_errors(where, namespace, injected)
    if namespace.headless or namespace.node_rank not in (None, 0):
        errors.append(f"{where}: the head is node 0: --node-rank 0, not --headless")
    pod_ip = [item["name"] for item in container.get("env", [])
              if item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP"]
    if namespace.master_addr not in {f"$({name})" for name in pod_ip}:
        errors.append(f"{where}: --master-addr {namespace.master_addr} must be this pod's IP, "
                      "$(POD_IP) with POD_IP from fieldRef status.podIP: the head listens "
                      "there for the workers")
    return errors


def worker_errors(container: dict, backend: str = "ray", injected: dict[str, str] | None = None,
                  head: argparse.Namespace | None = None) -> list[str]:
    """A Ray worker joins the head and blocks (deploy/docker/ray-worker.sh); it never serves.
    An mp worker is a headless pagellm node with the head's sizes and master port."""
    where = f"worker container {container.get('name')!r}"
    if backend == "mp":
        return _mp_worker_errors(where, container, injected or {}, head)
    words = [*container.get("command", []), *container.get("args", [])]
    if not any(WORKER_COMMAND in word for word in words):
        return [f"{where}: must run {WORKER_COMMAND} HEAD:PORT, which joins the Ray head"]
    return []


def _mp_worker_errors(where: str, container: dict, injected: dict[str, str],
                      head: argparse.Namespace | None) -> list[str]:
    kserve = {**injected, HEAD_SERVICE_VARIABLE: "model-head-1"}
    namespace, errors = _container_namespace(where, container, kserve)
    if namespace is None:
        return errors
    if namespace.verb != "serve" or not namespace.headless:
        return [f"{where}: must run `pagellm serve ... --headless`, which joins the head"]
    errors = _size_errors(where, namespace, injected) + _mp_node_errors(where, namespace,
                                                                         injected)
    if namespace.node_rank is not None:
        errors.append(f"{where}: --node-rank {namespace.node_rank} would be every worker "
                      "pod's (a Deployment's pods have no index): leave it out, the head "
                      "numbers the nodes as they join")
    if kserve[HEAD_SERVICE_VARIABLE] not in namespace.master_addr:
        errors.append(f"{where}: --master-addr {namespace.master_addr} must name the head's "
                      f"Service: $({HEAD_SERVICE_VARIABLE}).$(POD_NAMESPACE).svc.cluster.local")
    if head is not None and namespace.master_port != head.master_port:
        errors.append(f"{where}: --master-port {namespace.master_port} differs from the "
                      f"head's {head.master_port}")
    probe = " ".join(container.get("livenessProbe", {}).get("exec", {}).get("command", []))
    if HEAD_SERVICE_VARIABLE not in probe or f"/{namespace.master_port}" not in probe:
        errors.append(f"{where}: the livenessProbe must check the head's master port "
                      f"({HEAD_SERVICE_VARIABLE}, port {namespace.master_port})")
    return errors


def parallel_env(worker_spec: dict | None, override: dict | None = None) -> dict[str, str]:
    """What KServe injects into a multi-node pod: the sizes (the InferenceService's over the
    runtime's, 1 by default) and RAY_NODE_COUNT as the ray executor counts nodes (PP)."""
    if worker_spec is None and override is None:
        return {}
    sizes = {**(worker_spec or {}), **(override or {})}
    tensor = sizes.get("tensorParallelSize", 1)
    pipeline = sizes.get("pipelineParallelSize", 1)
    return {"TENSOR_PARALLEL_SIZE": str(tensor), "PIPELINE_PARALLEL_SIZE": str(pipeline),
            "RAY_NODE_COUNT": str(pipeline)}


def _probe_errors(container: dict, port: int) -> list[str]:
    where = f"container {container.get('name')!r}"
    named = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    errors = []
    if port not in {p["containerPort"] for p in container.get("ports", [])}:
        errors.append(f"{where}: pagellm listens on {port}, which no containerPort declares")
    for probe_name in _PROBES:
        probe = container.get(probe_name, {}).get("httpGet")
        if probe is None:
            continue
        probe_port = named.get(probe["port"], probe["port"])
        if probe_port != port:
            errors.append(f"{where}: {probe_name} asks port {probe['port']}, "
                          f"pagellm listens on {port}")
        if probe.get("path") != HEALTH_PATH:
            errors.append(f"{where}: {probe_name} path must be {HEALTH_PATH}")
    return errors


def pod_spec_errors(pod_spec: dict, mounts: tuple[str, ...] = (),
                    injected: dict[str, str] | None = None, backend: str = "ray") -> list[str]:
    return [error for container in pod_spec.get("containers", [])
            if is_pagellm_image(container.get("image", ""))
            for error in container_errors(container, mounts, injected, backend)]


def executor_backend(runtime_spec: dict) -> str:
    """How a multi-node runtime spreads its ranks: KServe's annotation, Ray when unset."""
    return (runtime_spec.get("annotations") or {}).get(EXECUTOR_BACKEND_ANNOTATION, "ray")


def runtime_errors(spec: dict) -> list[str]:
    """A runtime's head containers with the env its own workerSpec implies, and its workers."""
    worker_spec = spec.get("workerSpec")
    injected, backend = parallel_env(worker_spec), executor_backend(spec)
    errors = pod_spec_errors(spec, (KSERVE_MODEL_DIR,), injected, backend)
    head = _head_namespace(spec, injected)
    return errors + [error for container in (worker_spec or {}).get("containers", [])
                     if is_pagellm_image(container.get("image", ""))
                     for error in worker_errors(container, backend, injected, head)]


def _head_namespace(spec: dict, injected: dict[str, str]) -> argparse.Namespace | None:
    """The flags the runtime's pagellm head parses to, if it parses."""
    for container in spec.get("containers", []):
        if is_pagellm_image(container.get("image", "")):
            try:
                return parse_serve_args(container_argv(container, injected=injected))[0]
            except ValueError:
                return None
    return None


def document_errors(document: dict, runtimes: dict[str, dict]) -> list[str]:
    """pagellm's checks on one document; `runtimes` maps runtime names to their specs."""
    kind = document.get("kind")
    spec = document.get("spec", {})
    if kind in _POD_KINDS:
        return pod_spec_errors(spec.get("template", {}).get("spec", {}))
    if kind == "Pod":
        return pod_spec_errors(spec)
    if kind in _RUNTIME_KINDS:
        return runtime_errors(spec)
    if kind == "InferenceService":
        return _inference_service_errors(spec.get("predictor", {}), runtimes)
    if kind == "RayCluster":
        return _ray_cluster_errors(spec)
    return []


def _ray_cluster_errors(spec: dict) -> list[str]:
    """The head serves with the sizes its env gives ray-head.sh; every worker joins it."""
    errors = []
    for container in spec.get("headGroupSpec", {}).get("template", {}).get("spec", {}).get(
            "containers", []):
        if is_pagellm_image(container.get("image", "")):
            env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
            sizes = {key: env.get(key, "1") for key in _SIZE_ENV}
            errors += container_errors(container, injected=sizes)
    for group in spec.get("workerGroupSpecs", []):
        errors += [error for container in group.get("template", {}).get("spec", {}).get(
                   "containers", []) if is_pagellm_image(container.get("image", ""))
                   for error in worker_errors(container)]
    return errors


def _inference_service_errors(predictor: dict, runtimes: dict[str, dict]) -> list[str]:
    """The predictor's model merged into its runtime's container, as KServe merges them."""
    model = predictor.get("model", {})
    runtime = runtimes.get(model.get("runtime", ""))
    if runtime is None:
        return []
    worker_spec = predictor.get("workerSpec")
    if worker_spec is not None and runtime.get("workerSpec") is None:
        return [f"runtime {model['runtime']!r} runs pagellm on one node: a workerSpec needs "
                "a multi-node runtime such as pagellm-multinode"]
    injected = parallel_env(runtime.get("workerSpec"), worker_spec)
    errors = []
    for container in runtime.get("containers", []):
        if not is_pagellm_image(container.get("image", "")):
            continue
        merged = {**container, "args": [*container.get("args", []), *model.get("args", [])],
                  "env": [*container.get("env", []), *model.get("env", [])]}
        errors += container_errors(merged, (KSERVE_MODEL_DIR,), injected,
                                   executor_backend(runtime))
    return errors


def pagellm_runtimes(documents: list[dict]) -> dict[str, dict]:
    """The (Cluster)ServingRuntimes among `documents` whose containers run pagellm."""
    return {document["metadata"]["name"]: document["spec"] for document in documents
            if document.get("kind") in _RUNTIME_KINDS
            and any(is_pagellm_image(c.get("image", ""))
                    for c in document.get("spec", {}).get("containers", []))}
