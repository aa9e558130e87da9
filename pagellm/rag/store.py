"""The vector store: Qdrant through `qdrant-client`, local (a folder, nothing else to
install) by default, or a Qdrant server.

Points carry LangChain's payload layout (`page_content`, `metadata`), so
`langchain_qdrant.QdrantVectorStore` reads a collection ingested here. Local mode
holds an exclusive lock on its folder: one process at a time (a server, or the CLI),
which `StoreError` says in words, as it does for a store that no longer reads.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qdrant_client import QdrantClient, models
from qdrant_client.http.exceptions import ApiException, ResponseHandlingException

from pagellm.cache_dir import pagellm_cache_dir

CONTENT_KEY, METADATA_KEY = "page_content", "metadata"


class StoreError(RuntimeError):
    """The store cannot be used: locked, corrupt, or a server that does not answer."""


class StoreUnreachable(StoreError):
    """A Qdrant server that does not answer (it may come back)."""


@dataclass
class StoreSettings:
    path: str | None = None  # local mode; None: <pagellm cache>/qdrant (unless url)
    url: str | None = None
    api_key: str | None = None

    def describe(self) -> str:
        return f"Qdrant at {self.url}" if self.url else f"the local Qdrant store {self.where()}"

    def where(self) -> Path:
        return Path(self.path) if self.path else pagellm_cache_dir() / "qdrant"


@dataclass
class Hit:
    id: str
    score: float
    text: str
    metadata: dict[str, Any]

    @property
    def breadcrumb(self) -> str:
        return self.metadata.get("breadcrumb", "")

    @property
    def source(self) -> str:
        return self.metadata.get("source", "")


def open_client(settings: StoreSettings) -> QdrantClient:
    if settings.url:
        return QdrantClient(url=settings.url, api_key=settings.api_key, timeout=10)
    where = settings.where()
    if where.as_posix() == ":memory:":
        return QdrantClient(location=":memory:")
    where.mkdir(parents=True, exist_ok=True)
    try:
        return QdrantClient(path=str(where))
    except RuntimeError as error:
        if "already accessed" in str(error):
            raise StoreError(f"the local Qdrant store {where} is in use by another process "
                             "(local mode allows one at a time): stop it, or run a Qdrant "
                             "server and pass --qdrant-url.") from None
        raise
    except (sqlite3.DatabaseError, json.JSONDecodeError, KeyError, EOFError) as error:
        raise StoreError(f"the local Qdrant store {where} is corrupt ({error}); move it away "
                         "and ingest again.") from None


class VectorStore:
    def __init__(self, settings: StoreSettings, client: QdrantClient | None = None) -> None:
        self.settings = settings
        self.client = client or open_client(settings)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A client call; a server that does not answer becomes a StoreError."""
        try:
            return getattr(self.client, method)(*args, **kwargs)
        except ResponseHandlingException as error:
            raise StoreUnreachable(f"{self.settings.describe()} is unreachable ({error}).") from None
        except ApiException as error:
            raise StoreError(f"{self.settings.describe()} refused {method}: {error}") from None

    def ensure_collection(self, name: str, dimensions: int) -> None:
        if self._call("collection_exists", name):
            size = self._call("get_collection", name).config.params.vectors.size
            if size != dimensions:
                raise StoreError(f"collection {name!r} holds {size}-dimensional vectors; the "
                                 f"embedding model gives {dimensions}.")
            return
        self._call("create_collection", name, vectors_config=models.VectorParams(
            size=dimensions, distance=models.Distance.COSINE))

    def require_collection(self, name: str) -> None:
        if not self._call("collection_exists", name):
            raise StoreError(f"collection {name!r} does not exist in "
                             f"{self.settings.describe()}; run `pagellm rag ingest` first.")

    @staticmethod
    def _source_filter(source: str) -> models.Filter:
        return models.Filter(must=[models.FieldCondition(
            key=f"{METADATA_KEY}.source", match=models.MatchValue(value=source))])

    def source_hash(self, collection: str, source: str) -> tuple[str | None, int]:
        """The content hash stored with `source`'s chunks, and how many there are."""
        count = self._call("count", collection, count_filter=self._source_filter(source)).count
        if not count:
            return None, 0
        points, _ = self._call("scroll", collection, scroll_filter=self._source_filter(source),
                               limit=1, with_payload=True)
        return points[0].payload[METADATA_KEY].get("content_hash"), count

    def replace_source(self, collection: str, source: str, ids: list[str],
                       vectors: list[list[float]], payloads: list[dict]) -> None:
        """`source`'s old chunks out, the new ones in."""
        self._call("delete", collection, points_selector=models.FilterSelector(
            filter=self._source_filter(source)))
        points = [models.PointStruct(id=i, vector=v, payload=p)
                  for i, v, p in zip(ids, vectors, payloads, strict=True)]
        if points:
            self._call("upsert", collection, points=points)

    def query(self, collection: str, vector: list[float], limit: int) -> list[Hit]:
        response = self._call("query_points", collection, query=vector, limit=limit,
                              with_payload=True)
        return [Hit(str(point.id), point.score, point.payload.get(CONTENT_KEY, ""),
                    point.payload.get(METADATA_KEY, {})) for point in response.points]

    def close(self) -> None:
        self.client.close()
