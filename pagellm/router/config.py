"""The router's configuration: backend groups, public model names, rules and privacy.

A *group* is a set of interchangeable backends serving one model (replicas of a pagellm
model, or one external provider). A *public model* is a name clients send in `model`; its
rules pick a group per request. Every group name is also a public model that goes straight
to that group. The privacy section is applied to every request, whatever the model: a
request it flags can only reach groups whose backends are all `local: true`.

Loaded from YAML (`--config`) or built from the simple flags (`--backend URL ...`); every
unknown key is an error, so a typo can never silently switch a safeguard off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

BALANCING_POLICIES = ("round_robin", "least_loaded", "prefix", "session")
COMPLEXITY_TIERS = ("simple", "complex")
PII_ENTITIES = ("email", "phone", "iban", "credit_card", "national_id")


@dataclass
class BackendConfig:
    url: str                       # OpenAI base URL; "/v1" is appended when it has no path
    name: str = ""                 # shown in logs and metrics; defaults to the URL
    local: bool = False            # may receive customer data
    api_key_env: str | None = None  # environment variable holding the provider's API key

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"backend url {self.url!r} is not an http(s) URL")
        path = parts.path.rstrip("/") or "/v1"
        self.url = f"{parts.scheme}://{parts.netloc}{path}"
        self.name = self.name or self.url

    @property
    def root(self) -> str:
        """Where `/health`, `/metrics` and `/tokenize` live: the base URL less its "/v1"."""
        return self.url.removesuffix("/v1")

    def api_key(self) -> str | None:
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ValueError(f"environment variable {self.api_key_env} (API key of backend "
                             f"{self.name}) is not set")
        return key


@dataclass
class GroupConfig:
    name: str
    backends: list[BackendConfig]
    model: str = ""                # model name sent upstream; defaults to the group name
    balancing: str = "least_loaded"
    probe: bool = True             # poll /health and /metrics (off for external providers)
    block_size: int = 16           # the replicas' KV block size, for prefix hashing
    prefix_blocks: int = 8192      # LRU capacity per replica, in blocks (~ its KV cache)
    load_penalty: float = 4.0      # prefix score: blocks a request in flight or queued costs
    session_header: str = "x-session-id"

    def __post_init__(self) -> None:
        self.model = self.model or self.name
        if not self.backends:
            raise ValueError(f"group {self.name!r} has no backends")
        if self.balancing not in BALANCING_POLICIES:
            raise ValueError(f"group {self.name!r}: balancing must be one of "
                             f"{', '.join(BALANCING_POLICIES)}, not {self.balancing!r}")
        if self.block_size < 1 or self.prefix_blocks < 1 or self.load_penalty < 0:
            raise ValueError(f"group {self.name!r}: block_size and prefix_blocks must be "
                             f"positive and load_penalty not negative")

    @property
    def local(self) -> bool:
        return all(backend.local for backend in self.backends)


@dataclass
class Condition:
    """What a rule matches; every field given must hold (AND). Empty matches everything."""

    tags: list[str] = field(default_factory=list)        # any of these request tags
    tenants: list[str] = field(default_factory=list)     # any of these tenants
    headers: dict[str, str] = field(default_factory=dict)  # header: exact value
    min_prompt_tokens: int | None = None
    max_prompt_tokens: int | None = None
    complexity: str | None = None                         # "simple" or "complex"

    def __post_init__(self) -> None:
        if self.complexity is not None and self.complexity not in COMPLEXITY_TIERS:
            raise ValueError(f"complexity must be one of {COMPLEXITY_TIERS}")
        self.headers = {key.lower(): value for key, value in self.headers.items()}


@dataclass
class Rule:
    name: str
    target: str                    # a group name
    when: Condition = field(default_factory=Condition)


@dataclass
class ModelRoute:
    """A public model name: rules in order, then the default; fallbacks for the rest."""

    name: str
    default: str
    rules: list[Rule] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)


@dataclass
class PrivacyConfig:
    """What makes a request customer data, and where such requests go."""

    local_group: str | None = None
    pii: list[str] = field(default_factory=lambda: list(PII_ENTITIES))
    phone_regions: list[str] = field(default_factory=lambda: ["US", "FR", "DE", "GB"])
    customer_names: list[str] = field(default_factory=list)
    customer_names_file: str | None = None
    patterns: dict[str, str] = field(default_factory=dict)  # name: regular expression
    tags: list[str] = field(default_factory=lambda: ["customer-data"])
    tenants: list[str] = field(default_factory=list)        # every request is customer data

    def __post_init__(self) -> None:
        unknown = set(self.pii) - set(PII_ENTITIES)
        if unknown:
            raise ValueError(f"privacy.pii: unknown entities {sorted(unknown)}; known: "
                             f"{', '.join(PII_ENTITIES)}")
        if self.customer_names_file:
            text = Path(self.customer_names_file).read_text(encoding="utf-8")
            self.customer_names += [line.strip() for line in text.splitlines() if line.strip()]


@dataclass
class ClassifierConfig:
    """The classifier tier: the request's task embedded by a local embedding group and
    compared with the centroids of labelled examples (cosine similarity)."""

    group: str                     # a group of local backends serving `/v1/embeddings`
    simple: list[str]
    complex: list[str]
    margin: float = 0.0            # complex when its centroid is closer by more than this
    on_error: str = "simple"       # the tier when the classifier cannot answer
    timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.simple or not self.complex:
            raise ValueError("complexity.classifier needs `simple` and `complex` examples")
        if self.on_error not in COMPLEXITY_TIERS:
            raise ValueError(f"complexity.classifier.on_error must be one of "
                             f"{COMPLEXITY_TIERS}, not {self.on_error!r}")


@dataclass
class ComplexityConfig:
    """The cheap heuristic tier (a score from length and task words, `complex` at
    threshold), replaced by the classifier tier when `classifier` is set."""

    threshold: float = 3.0
    keywords: list[str] = field(default_factory=lambda: [
        "prove", "derive", "step by step", "analyze", "analyse", "design", "architecture",
        "optimize", "trade-off", "compare", "refactor", "algorithm", "explain why",
        "reasoning", "plan"])
    classifier: ClassifierConfig | None = None


@dataclass
class RouterConfig:
    groups: dict[str, GroupConfig]
    models: dict[str, ModelRoute] = field(default_factory=dict)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    complexity: ComplexityConfig = field(default_factory=ComplexityConfig)
    tenants: dict[str, str] = field(default_factory=dict)  # tenant: env var with its API key
    host: str = "127.0.0.1"
    port: int = 8080
    probe_interval_s: float = 1.0
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    max_failures: int = 2          # consecutive failures that eject a backend
    cooldown_s: float = 10.0       # ejection time of a backend that is not probed
    retry_budget: int = 3          # upstream attempts per request, all groups together

    def __post_init__(self) -> None:
        self._check_names()
        privacy = self.privacy
        if privacy.local_group is None:
            privacy.local_group = next((g.name for g in self.groups.values() if g.local), None)
        elif privacy.local_group not in self.groups or not self.groups[privacy.local_group].local:
            raise ValueError(f"privacy.local_group {privacy.local_group!r} must name a group "
                             f"whose backends are all `local: true`")
        for tenant in privacy.tenants:
            if tenant not in self.tenants:
                raise ValueError(f"privacy.tenants: {tenant!r} is not in `tenants`")
        classifier = self.complexity.classifier
        # the classifier sees every request's text, customer data included
        if classifier is not None and (classifier.group not in self.groups
                                       or not self.groups[classifier.group].local):
            raise ValueError(f"complexity.classifier.group {classifier.group!r} must name a "
                             f"group whose backends are all `local: true`")

    def _check_names(self) -> None:
        clashes = set(self.models) & set(self.groups)
        if clashes:
            raise ValueError(f"names used for both a model and a group: {sorted(clashes)}")
        for route in self.models.values():
            targets = [route.default, *route.fallbacks, *(rule.target for rule in route.rules)]
            for target in targets:
                if target not in self.groups:
                    raise ValueError(f"model {route.name!r}: unknown group {target!r}")
            for rule in route.rules:
                for tenant in rule.when.tenants:
                    if tenant not in self.tenants:
                        raise ValueError(f"rule {rule.name!r}: unknown tenant {tenant!r}")

    @property
    def public_models(self) -> list[str]:
        return [*self.models, *self.groups]


def _build(cls: type, data: Any, where: str) -> Any:
    """A dataclass from a mapping, refusing keys it does not have."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    return cls(**data)


def _group(name: str, data: dict[str, Any]) -> GroupConfig:
    data = dict(data)
    shared = {key: data.pop(key) for key in ("local", "api_key_env") if key in data}
    backends = []
    for index, item in enumerate(data.pop("backends", [])):
        item = {"url": item} if isinstance(item, str) else item
        backends.append(_build(BackendConfig, {**shared, **item},
                               f"groups.{name}.backends[{index}]"))
    return _build(GroupConfig, {**data, "name": name, "backends": backends}, f"groups.{name}")


def _route(name: str, data: dict[str, Any]) -> ModelRoute:
    data = dict(data)
    rules = []
    for index, item in enumerate(data.pop("rules", [])):
        item = dict(item)
        when = _build(Condition, item.pop("when", {}) or {}, f"models.{name}.rules[{index}].when")
        rules.append(_build(Rule, {**item, "when": when}, f"models.{name}.rules[{index}]"))
    return _build(ModelRoute, {**data, "name": name, "rules": rules}, f"models.{name}")


def config_from_dict(data: dict[str, Any]) -> RouterConfig:
    data = dict(data)
    groups = {name: _group(name, item or {}) for name, item in (data.pop("groups", {})).items()}
    models = {name: _route(name, item or {}) for name, item in (data.pop("models", {})).items()}
    privacy = _build(PrivacyConfig, data.pop("privacy", {}) or {}, "privacy")
    complexity_data = dict(data.pop("complexity", {}) or {})
    if complexity_data.get("classifier") is not None:
        complexity_data["classifier"] = _build(ClassifierConfig, complexity_data["classifier"],
                                               "complexity.classifier")
    complexity = _build(ComplexityConfig, complexity_data, "complexity")
    if not groups:
        raise ValueError("the router needs at least one group of backends")
    return _build(RouterConfig, {**data, "groups": groups, "models": models,
                                 "privacy": privacy, "complexity": complexity}, "config")


def load_config(path: str | Path) -> RouterConfig:
    with open(path, encoding="utf-8") as handle:
        data = yaml.safe_load(handle) or {}
    return config_from_dict(data)
