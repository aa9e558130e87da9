"""Picking a replica of a group: round-robin, least-loaded, prefix-aware or session affinity.

Every policy breaks ties by a rotating start, never by configuration order, so equal
replicas share the traffic instead of the first one taking it all (the starvation
LiteLLM's and production-stack's users reported). The prefix policy scores a replica
`matched blocks - load_penalty * load`, so a hot prefix spills over to a second replica
once the first is busy instead of pinning a saturated one.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagellm.logger import init_logger
from pagellm.router.backends import Backend, BackendPool
from pagellm.core.prefix_index import PrefixIndex, block_hashes
from pagellm.router.prefix import prompt_tokens

logger = init_logger(__name__)


@dataclass
class Affinity:
    """What a request brings to the choice, computed once and kept across retries."""

    hashes: list[bytes] | None = None   # its prompt's block hashes (prefix policy)
    session: str | None = None          # its session header (session policy)
    matched: dict[str, int] = field(default_factory=dict)


class Balancer:
    def __init__(self, pool: BackendPool, client: httpx.AsyncClient) -> None:
        self.pool = pool
        self.client = client
        self._turn = {name: itertools.count() for name in pool.groups}
        self.indexes = {name: PrefixIndex(group.prefix_blocks)
                        for name, group in pool.config.groups.items()}
        pool.on_eject.append(self._forget)

    def _forget(self, backend: Backend) -> None:
        self.indexes[backend.group].forget(backend.name)

    async def affinity(self, group: str, body: dict[str, Any],
                       headers: dict[str, str]) -> Affinity:
        config = self.pool.group_config(group)
        if config.balancing == "session":
            return Affinity(session=headers.get(config.session_header.lower()))
        if config.balancing != "prefix":
            return Affinity()
        tokens = await self.tokens(group, body)
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        return Affinity(hashes=None if tokens is None else
                        block_hashes(tokens, config.block_size, salt))

    async def tokens(self, group: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids from the first replica of `group` whose `/tokenize`
        answers; None when the request has no prompt to tokenize or none answers."""
        config = self.pool.group_config(group)
        for backend in self.pool.available(group):
            try:
                return await prompt_tokens(self.client, backend.config.root, body,
                                           config.model, self.pool.config.connect_timeout_s)
            except (httpx.HTTPError, KeyError, ValueError) as error:
                logger.warning("/tokenize on %s failed (%s); trying another replica",
                               backend.name, type(error).__name__)
        return None

    async def count_tokens(self, body: dict[str, Any]) -> int:
        """Prompt tokens for the size rules, counted by the local group (which may see any
        request), never by an external provider."""
        group = self.pool.config.privacy.local_group
        tokens = None if group is None else await self.tokens(group, body)
        if tokens is None:
            raise ValueError("no local replica could count the prompt's tokens")
        return len(tokens)

    def pick(self, group: str, affinity: Affinity, exclude: set[str]) -> Backend | None:
        candidates = [b for b in self.pool.available(group) if b.name not in exclude]
        if not candidates:
            return None
        start = next(self._turn[group]) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        config = self.pool.group_config(group)
        policy = config.balancing
        if policy == "round_robin":
            return rotated[0]
        if policy == "session" and affinity.session is not None:
            return _rendezvous(candidates, affinity.session)
        if policy == "prefix" and affinity.hashes:
            index = self.indexes[group]
            affinity.matched = {b.name: index.matched_blocks(b.name, affinity.hashes)
                                for b in candidates}
            return max(rotated, key=lambda b: (affinity.matched[b.name]
                                               - config.load_penalty * b.load, -b.load))
        return min(rotated, key=lambda b: (b.load, b.kv_usage))

    @staticmethod
    def sent(backend: Backend) -> None:
        backend.in_flight += 1

    def served(self, backend: Backend, affinity: Affinity) -> None:
        """`backend` accepted the request: it now holds the prompt's blocks."""
        if affinity.hashes:
            self.indexes[backend.group].record(backend.name, affinity.hashes)

    @staticmethod
    def finished(backend: Backend) -> None:
        backend.in_flight -= 1


def _rendezvous(candidates: list[Backend], key: str) -> Backend:
    """Highest-random-weight hashing: a session keeps its replica while that one is up, and
    only the sessions of a replica that leaves move."""
    def weight(backend: Backend) -> bytes:
        return hashlib.blake2b(f"{backend.name}\0{key}".encode(), digest_size=8).digest()
    return max(candidates, key=weight)
