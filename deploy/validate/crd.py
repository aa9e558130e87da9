"""KServe resources against KServe's own CRD OpenAPI schemas, made strict.

A CRD schema sets no `additionalProperties`, so an API server prunes an unknown field
silently: `tensorParalelSize` would be dropped and the default used. Here every object schema
that lists its properties refuses others, the way `kubectl --validate=strict` does.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft7Validator

KSERVE_GROUP = "serving.kserve.io"
_CRD_FILES = ("serving.kserve.io_clusterservingruntimes.yaml",
              "serving.kserve.io_servingruntimes.yaml",
              "serving.kserve.io_inferenceservices.yaml",
              "serving.kserve.io_inferencegraphs.yaml")


def strict(schema: Any) -> Any:
    """A copy of `schema` where each object with `properties` refuses unlisted ones."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: strict(value) for key, value in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        result["additionalProperties"] = False
    return result


@functools.cache
def kserve_validators(schema_dir: Path) -> dict[tuple[str, str], Draft7Validator]:
    """{(apiVersion, kind): validator} for the CRD files in `schema_dir`."""
    validators = {}
    for name in _CRD_FILES:
        crd = yaml.load((schema_dir / name).read_text(), Loader=yaml.CSafeLoader)
        kind = crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
            validators[(f"{crd['spec']['group']}/{version['name']}", kind)] = \
                Draft7Validator(schema)
    return validators


def schema_errors(validator: Draft7Validator, document: dict) -> list[str]:
    return [f"{'.'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
            for error in sorted(validator.iter_errors(document), key=lambda e: e.json_path)]


def _object(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {"type": "object"}  # checked by documents.metadata_errors
# The fields of the Prometheus Operator's ServiceMonitor (monitoring.coreos.com/v1) that the
# chart renders, typed as the operator's CRD types them; no copy of that CRD lies beside the
# project, so a field the chart starts to render must be added here first.
SERVICE_MONITOR_SCHEMA = _object({
    "apiVersion": {"const": "monitoring.coreos.com/v1"},
    "kind": {"const": "ServiceMonitor"},
    "metadata": _METADATA,
    "spec": _object({
        "selector": _object({"matchLabels": _STRING_MAP}),
        "namespaceSelector": _object({"matchNames": {"type": "array",
                                                     "items": {"type": "string"}}}),
        "endpoints": {"type": "array", "minItems": 1, "items": _object({
            "port": {"type": "string"},
            "path": {"type": "string"},
            "interval": {"type": "string", "pattern": "^(0|(([0-9]+)(ms|s|m|h))+)$"},
            "scheme": {"enum": ["http", "https"]},
        }, required=("port",))},
    }, required=("selector", "endpoints")),
}, required=("apiVersion", "kind", "metadata", "spec"))


_POD_TEMPLATE = {"type": "object"}  # checked as a core PodTemplate by documents.py
_START_PARAMS = {"type": "object", "additionalProperties": {"type": "string"}}
_COUNT = {"type": "integer", "minimum": 0}
# The fields of KubeRay's RayCluster (ray.io/v1) that the chart renders, typed as KubeRay's
# CRD types them; as for ServiceMonitor, no copy of that CRD lies beside the project.
RAY_CLUSTER_SCHEMA = _object({
    "apiVersion": {"const": "ray.io/v1"},
    "kind": {"const": "RayCluster"},
    "metadata": _METADATA,
    "spec": _object({
        "rayVersion": {"type": "string"},
        "headGroupSpec": _object({
            "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
            "rayStartParams": _START_PARAMS,
            "template": _POD_TEMPLATE,
        }, required=("template",)),
        "workerGroupSpecs": {"type": "array", "items": _object({
            "groupName": {"type": "string", "minLength": 1},
            "replicas": _COUNT,
            "minReplicas": _COUNT,
            "maxReplicas": _COUNT,
            "rayStartParams": _START_PARAMS,
            "template": _POD_TEMPLATE,
        }, required=("groupName", "template"))},
    }, required=("headGroupSpec",)),
}, required=("apiVersion", "kind", "metadata", "spec"))


def ray_pod_templates(document: dict) -> dict[str, dict]:
    """{path: pod template} of a RayCluster's head and worker groups."""
    spec = document.get("spec", {})
    templates = {"spec.headGroupSpec.template": spec.get("headGroupSpec", {}).get("template")}
    for index, group in enumerate(spec.get("workerGroupSpecs", [])):
        templates[f"spec.workerGroupSpecs.{index}.template"] = group.get("template")
    return {path: template for path, template in templates.items() if template is not None}


def other_validators() -> dict[tuple[str, str], Draft7Validator]:
    return {("monitoring.coreos.com/v1", "ServiceMonitor"):
            Draft7Validator(SERVICE_MONITOR_SCHEMA),
            ("ray.io/v1", "RayCluster"): Draft7Validator(RAY_CLUSTER_SCHEMA)}
