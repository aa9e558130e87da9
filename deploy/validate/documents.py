"""One entry point for every kind a pagellm deployment renders: core kinds against
Kubernetes' own schemas (`kubernetes-validate --strict`), KServe kinds against KServe's CRDs
(strict) and webhook rules, and pagellm's flags on every container that runs it."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import kubernetes_validate
import yaml

from deploy.validate import crd, kserve_rules, pagellm_args

KUBERNETES_VERSION = "1.33"
# <repo root>/../shared/schemas/kserve, where CI lays out the shared folder
DEFAULT_KSERVE_SCHEMAS = Path(__file__).resolve().parents[3] / "shared" / "schemas" / "kserve"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_METADATA_KEYS = {"name", "namespace", "labels", "annotations", "generateName"}


@dataclass
class Validator:
    kserve_schemas: Path = DEFAULT_KSERVE_SCHEMAS
    kubernetes_version: str = KUBERNETES_VERSION
    seen_kinds: set[str] = field(default_factory=set)

    def errors(self, documents: list[dict]) -> list[str]:
        """One line per problem, each prefixed with the document's kind and name."""
        runtimes = pagellm_args.pagellm_runtimes(documents)
        problems = []
        for document in documents:
            label = f"{document.get('kind')}/{document.get('metadata', {}).get('name')}"
            self.seen_kinds.add(str(document.get("kind")))
            for error in (self._schema_errors(document)
                          + pagellm_args.document_errors(document, runtimes)):
                problems.append(f"{label}: {error}")
        return problems

    def _schema_errors(self, document: dict) -> list[str]:
        key = (document.get("apiVersion", ""), document.get("kind", ""))
        if key[0].startswith(crd.KSERVE_GROUP + "/"):
            validator = crd.kserve_validators(self.kserve_schemas).get(key)
            if validator is None:
                return [f"no KServe schema for {key[0]} {key[1]}"]
            return (metadata_errors(document) + crd.schema_errors(validator, document)
                    + _kserve_rule_errors(document))
        other = crd.other_validators().get(key)
        if other is not None:
            return (metadata_errors(document) + crd.schema_errors(other, document)
                    + [error for path, template in crd.ray_pod_templates(document).items()
                       for error in self._pod_template_errors(path, template)])
        try:
            kubernetes_validate.validate(document, self.kubernetes_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(p) for p in error.path) or "<root>"
            return [f"{path}: {error.message}"]
        except kubernetes_validate.SchemaNotFoundError:
            return [f"no schema for {key[0]} {key[1]}: this validator knows core kinds, "
                    "KServe's, ServiceMonitor and RayCluster"]
        return []

    def _pod_template_errors(self, path: str, template: dict) -> list[str]:
        """A CRD's embedded pod template, strictly, as the core PodTemplate kind holds one."""
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                   "template": template}
        try:
            kubernetes_validate.validate(wrapped, self.kubernetes_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            inner = ".".join(str(p) for p in list(error.path)[1:])
            return [f"{path}{'.' + inner if inner else ''}: {error.message}"]
        return []


def _kserve_rule_errors(document: dict) -> list[str]:
    if document["kind"] == "InferenceGraph":
        return kserve_rules.inference_graph_errors(document)
    if document["kind"] == "InferenceService":
        return kserve_rules.multinode_errors(document)
    if document["kind"] in ("ServingRuntime", "ClusterServingRuntime"):
        return kserve_rules.runtime_multinode_errors(document)
    return []


def metadata_errors(document: dict) -> list[str]:
    """CRDs leave `metadata` untyped; the API server still checks what is checked here."""
    metadata = document.get("metadata") or {}
    errors = [f"metadata.{key}: not an ObjectMeta field" for key in metadata
              if key not in _METADATA_KEYS]
    if not _DNS_LABEL.match(str(metadata.get("name", ""))):
        errors.append(f"metadata.name {metadata.get('name')!r} is not a DNS-1123 label")
    for key in ("labels", "annotations"):
        if any(not isinstance(v, str) for v in (metadata.get(key) or {}).values()):
            errors.append(f"metadata.{key}: values must be strings")
    return errors


def load_documents(texts: Iterable[str]) -> list[dict]:
    return [document for text in texts for document in yaml.safe_load_all(text)
            if document]
