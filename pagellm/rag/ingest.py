"""`pagellm rag ingest`: files to chunks to vectors to Qdrant points, idempotently.

A point's id is derived from its source and position (uuid5), and each point records
the hash of its file's content: ingesting the same file again is a no-op, a changed
one has its old chunks deleted and its new ones written.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

from pagellm.rag.chunking import SUFFIXES, Chunk, chunk_document, read_sections
from pagellm.rag.embedder import Embedder
from pagellm.rag.store import CONTENT_KEY, METADATA_KEY, VectorStore

_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://pagellm/rag")


@dataclass
class IngestReport:
    files: int = 0
    skipped: int = 0  # unchanged since the last ingestion
    chunks: int = 0


def find_files(paths: Iterable[str]) -> list[Path]:
    """The files named, and the Markdown, HTML and text files under the folders named."""
    found: list[Path] = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found.extend(sorted(p for p in path.rglob("*")
                                if p.is_file() and p.suffix.lower() in SUFFIXES))
        elif path.is_file():
            found.append(path)
        else:
            raise FileNotFoundError(f"{name}: no such file or folder.")
    return found


def source_name(path: Path) -> str:
    """The path relative to the working folder when it is under it, else absolute."""
    absolute = os.path.abspath(path)  # symlinks kept: a linked folder names its files
    relative = os.path.relpath(absolute)
    return Path(relative).as_posix() if not relative.startswith("..") else absolute


def point_id(source: str, index: int) -> str:
    return str(uuid.uuid5(_ID_NAMESPACE, f"{source}#{index}"))


def content_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def chunk_file(path: Path, embedder: Embedder, breadcrumbs: bool = True) -> list[Chunk]:
    source = source_name(path)
    modified = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).date().isoformat()
    metadata = {"date": modified, "content_hash": content_hash(path)}
    return chunk_document(source, read_sections(path), metadata, embedder.count_tokens,
                          embedder.max_tokens, breadcrumbs)


def payload_of(chunk: Chunk) -> dict:
    return {CONTENT_KEY: chunk.text, METADATA_KEY: chunk.metadata}


def ingest(paths: Iterable[str], collection: str, store: VectorStore, embedder: Embedder,
           breadcrumbs: bool = True, progress: bool = True) -> IngestReport:
    files = find_files(paths)
    store.ensure_collection(collection, embedder.dimensions)
    report = IngestReport(files=len(files))
    bar = tqdm(files, desc="Ingesting", unit="file", disable=not progress)
    for path in bar:
        source = source_name(path)
        bar.set_postfix_str(source[-40:])
        if store.source_hash(collection, source)[0] == content_hash(path):
            report.skipped += 1
            continue
        chunks = chunk_file(path, embedder, breadcrumbs)
        vectors = embedder.embed([chunk.embedded_text for chunk in chunks]) if chunks else []
        store.replace_source(collection, source, [point_id(source, c.index) for c in chunks],
                             vectors, [payload_of(chunk) for chunk in chunks])
        report.chunks += len(chunks)
    return report
