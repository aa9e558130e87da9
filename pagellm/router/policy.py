"""Which group a request goes to: privacy first, then the model's rules, then fallbacks.

The privacy check runs on every request, whatever model it names and whatever the rules
say: a request tagged as customer data, sent with a tenant key marked private, or in which
the PII detector finds anything (or fails) is *sensitive*. A sensitive request keeps only
the local groups among its candidates, and the privacy section's local group is added
last; with none healthy it gets a 503, never an external call. No rule order, fallback or
retry can undo that, because the candidate list the proxy walks is built here.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pagellm.logger import init_logger
from pagellm.router.complexity import ComplexityEstimator
from pagellm.router.config import Condition, RouterConfig
from pagellm.router.pii import PIIDetector

logger = init_logger(__name__)

TAGS_HEADER = "x-pagellm-tags"
TokenCounter = Callable[[dict[str, Any]], Awaitable[int]]


@dataclass
class RequestInfo:
    model: str
    body: dict[str, Any]
    headers: dict[str, str]        # lower-case names
    tags: set[str] = field(default_factory=set)
    tenant: str | None = None
    complexity: str | None = None  # its tier, once a rule asked


@dataclass
class RouteDecision:
    rule: str                      # the rule that chose, or "default", "privacy(...)"
    groups: list[str]              # target first, then the fallbacks still allowed
    sensitive: bool

    @property
    def header(self) -> str:
        target = self.groups[0] if self.groups else "none"
        return f"rule={self.rule}; target={target}; sensitive={str(self.sensitive).lower()}"


class Policy:
    def __init__(self, config: RouterConfig, count_tokens: TokenCounter,
                 complexity: ComplexityEstimator) -> None:
        self.config = config
        self.detector = PIIDetector(config.privacy)
        self.count_tokens = count_tokens
        self.complexity = complexity
        self._tenant_keys = {}
        for tenant, env in config.tenants.items():
            key = os.environ.get(env)
            if not key:
                raise ValueError(f"environment variable {env} (API key of tenant {tenant}) "
                                 f"is not set")
            self._tenant_keys[tenant] = f"Bearer {key}"

    def request_info(self, body: dict[str, Any], headers: dict[str, str]) -> RequestInfo:
        tags = {tag.strip() for tag in headers.get(TAGS_HEADER, "").split(",") if tag.strip()}
        given = headers.get("authorization", "")
        tenant = next((name for name, expected in self._tenant_keys.items()
                       if secrets.compare_digest(given.encode(), expected.encode())), None)
        return RequestInfo(str(body.get("model")), body, headers, tags, tenant)

    def privacy_reason(self, info: RequestInfo) -> str | None:
        """Why the request is customer data, or None. Never raises: a failing detector is
        itself a reason (fail closed)."""
        privacy = self.config.privacy
        tagged = sorted(info.tags & set(privacy.tags))
        if tagged:
            return f"tag:{tagged[0]}"
        if info.tenant in privacy.tenants:
            return f"tenant:{info.tenant}"
        try:
            findings = self.detector.scan(info.body)
        except Exception as error:  # noqa: BLE001 - any detector failure must fail closed
            logger.warning("PII detector failed (%s); treating the request as customer data",
                           type(error).__name__)
            return "detector-error"
        if findings:
            return "pii:" + ",".join(finding.entity for finding in findings)
        return None

    async def _matches(self, when: Condition, info: RequestInfo) -> bool:
        if when.tags and not info.tags & set(when.tags):
            return False
        if when.tenants and info.tenant not in when.tenants:
            return False
        if any(info.headers.get(name) != value for name, value in when.headers.items()):
            return False
        if when.complexity is not None:
            if info.complexity is None:
                info.complexity = await self.complexity.tier(info.body)
            if info.complexity != when.complexity:
                return False
        if when.min_prompt_tokens is not None or when.max_prompt_tokens is not None:
            count = await self.count_tokens(info.body)
            if when.min_prompt_tokens is not None and count < when.min_prompt_tokens:
                return False
            if when.max_prompt_tokens is not None and count > when.max_prompt_tokens:
                return False
        return True

    async def _by_rules(self, info: RequestInfo) -> tuple[str, list[str]]:
        if info.model in self.config.groups:
            return "model", [info.model]
        route = self.config.models[info.model]
        target, chosen = route.default, "default"
        for rule in route.rules:
            try:
                matched = await self._matches(rule.when, info)
            except Exception as error:  # noqa: BLE001 - a rule that cannot be evaluated
                logger.warning("Rule %s could not be evaluated (%s: %s); skipping it",
                               rule.name, type(error).__name__, error)
                continue
            if matched:
                target, chosen = rule.target, rule.name
                break
        fallbacks = [group for group in route.fallbacks if group != target]
        return chosen, [target, *fallbacks]

    async def decide(self, info: RequestInfo) -> RouteDecision:
        """`info.model` must be a public model name (checked by the caller)."""
        reason = self.privacy_reason(info)
        rule, groups = await self._by_rules(info)
        if reason is None:
            return RouteDecision(rule, groups, sensitive=False)
        local = [group for group in groups if self.config.groups[group].local]
        privacy_group = self.config.privacy.local_group
        if privacy_group is not None and privacy_group not in local:
            local.append(privacy_group)
        return RouteDecision(f"privacy({reason})", local, sensitive=True)
