"""`pagellm rag ingest` and `query`: chunking, breadcrumbs, idempotence, the payload
layout LangChain reads, and the store's errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pagellm.rag.chunking import chunk_document, html_sections, markdown_sections
from pagellm.rag.embedder import Embedder
from pagellm.rag.ingest import ingest, point_id
from pagellm.rag.store import StoreError, StoreSettings, VectorStore
from tests.rag_utils import minilm_path
from tests.server_utils import run_cli

GUIDE = """# Install guide

Intro paragraph.

## Kubernetes

```bash
# not a heading: a shell comment
helm install pagellm
```

### KServe

Use an InferenceGraph with a retriever step.

## Docker

Run the image with --port 8000.
"""


def _words(text: str) -> int:
    return len(text.split()) + 2  # two special tokens, as a BERT tokenizer adds


def test_markdown_sections_follow_headings_not_code_comments() -> None:
    sections = markdown_sections(GUIDE, "fallback")
    assert [s.headings for s in sections] == [
        ["Install guide"], ["Install guide", "Kubernetes"],
        ["Install guide", "Kubernetes", "KServe"], ["Install guide", "Docker"]]
    assert "# not a heading" in sections[1].text


def test_html_sections_use_title_and_headings() -> None:
    html = ("<html><head><title>Ops</title><style>p{}</style></head><body><h1>Ops</h1>"
            "<p>top</p><h2>Backups</h2><p>nightly</p><script>x()</script>"
            "<h3>Restore</h3><p>from S3</p></body></html>")
    sections = html_sections(html, "fallback")
    assert [(s.headings, s.text) for s in sections] == [
        (["Ops"], "top"), (["Ops", "Backups"], "nightly"),
        (["Ops", "Backups", "Restore"], "from S3")]


def test_chunks_never_exceed_the_limit_and_carry_breadcrumbs() -> None:
    body = "\n\n".join(f"Paragraph {i} " + "word " * 30 for i in range(10))
    sections = markdown_sections(f"# Doc\n\n## Long\n\n{body}\n\n## Short\n\nshort text", "d")
    chunks = chunk_document("doc.md", sections, {"date": "2026-01-01"}, _words, 80)
    assert len(chunks) > 3
    assert all(_words(c.embedded_text) <= 80 for c in chunks)
    assert chunks[0].embedded_text.startswith("Doc > Long\nSource: doc.md | 2026-01-01\n\n")
    assert chunks[-1].breadcrumb == "Doc > Short" and chunks[-1].text == "short text"
    assert [c.index for c in chunks] == list(range(len(chunks)))
    plain = chunk_document("doc.md", sections, {}, _words, 80, breadcrumbs=False)
    assert all(c.embedded_text == c.text for c in plain)
    one_long_line = markdown_sections("# T\n\n" + "w " * 500, "t")
    assert all(_words(c.embedded_text) <= 80
               for c in chunk_document("t.md", one_long_line, {}, _words, 80))


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder(str(minilm_path()))


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "guide.md").write_text(GUIDE)
    (docs / "sub" / "ops.html").write_text(
        "<h1>Ops</h1><h2>Backups</h2><p>Backups run nightly to S3.</p>")
    (docs / "notes.txt").write_text("Plain notes about the retriever.")
    (docs / "image.png").write_bytes(b"\x89PNG")  # not a document: skipped by the walk
    return docs


@pytest.fixture()
def store(tmp_path: Path) -> Iterator[VectorStore]:
    opened = VectorStore(StoreSettings(path=str(tmp_path / "qdrant")))
    yield opened
    opened.close()


def _all_points(store: VectorStore, collection: str) -> list:
    points, _ = store.client.scroll(collection, limit=1000, with_payload=True)
    return points


def test_ingest_is_idempotent_and_replaces_a_changed_file(corpus: Path, store: VectorStore,
                                                          embedder: Embedder,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(corpus.parent)
    first = ingest(["docs"], "c", store, embedder, progress=False)
    assert (first.files, first.skipped, first.chunks) == (3, 0, 6)
    points = _all_points(store, "c")
    ids = {str(p.id) for p in points}
    assert point_id("docs/guide.md", 0) in ids and len(ids) == 6
    again = ingest(["docs"], "c", store, embedder, progress=False)
    assert (again.skipped, again.chunks) == (3, 0)
    (corpus / "guide.md").write_text("# Install guide\n\n## Docker\n\nOnly Docker now.\n")
    changed = ingest(["docs"], "c", store, embedder, progress=False)
    assert (changed.skipped, changed.chunks) == (2, 1)
    guide = [p for p in _all_points(store, "c") if p.payload["metadata"]["source"]
             == "docs/guide.md"]
    assert [p.payload["page_content"] for p in guide] == ["Only Docker now."]
    assert guide[0].payload["metadata"]["breadcrumb"] == "Install guide > Docker"


def test_langchain_reads_the_collection(corpus: Path, store: VectorStore, embedder: Embedder,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    langchain_qdrant = pytest.importorskip("langchain_qdrant")
    from langchain_core.embeddings import Embeddings

    class MiniLM(Embeddings):
        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            return embedder.embed(texts)

        def embed_query(self, text: str) -> list[float]:
            return embedder.embed([text])[0]

    monkeypatch.chdir(corpus.parent)
    ingest(["docs"], "lc", store, embedder, progress=False)
    vector_store = langchain_qdrant.QdrantVectorStore(client=store.client, collection_name="lc",
                                                      embedding=MiniLM())
    found = vector_store.similarity_search("When do backups run?", k=1)
    assert found[0].page_content == "Backups run nightly to S3."
    assert found[0].metadata["breadcrumb"] == "Ops > Backups"
    assert found[0].metadata["source"] == "docs/sub/ops.html"


def test_a_locked_store_is_a_clear_error(tmp_path: Path, store: VectorStore) -> None:
    with pytest.raises(StoreError, match="in use by another process"):
        VectorStore(StoreSettings(path=str(tmp_path / "qdrant")))


def test_a_corrupt_store_is_a_clear_error(tmp_path: Path, corpus: Path,
                                          embedder: Embedder) -> None:
    where = tmp_path / "broken"
    opened = VectorStore(StoreSettings(path=str(where)))
    ingest([str(corpus / "notes.txt")], "c", opened, embedder, progress=False)
    opened.close()
    (where / "collection" / "c" / "storage.sqlite").write_bytes(b"not sqlite" * 50)
    with pytest.raises(StoreError, match="is corrupt"):
        VectorStore(StoreSettings(path=str(where)))


def test_cli_ingest_then_query_prints_scores_and_breadcrumbs(corpus: Path,
                                                             tmp_path: Path) -> None:
    store = ["--collection", "cli", "--qdrant-path", str(tmp_path / "cli-store")]
    ingested = run_cli("rag", "ingest", str(corpus), *store, timeout=300)
    assert ingested.returncode == 0, ingested.stderr
    assert "Ingested 3 file(s) into 'cli' (6 chunks)" in ingested.stdout
    answer = run_cli("rag", "query", "When do backups run?", "--top-k", "2", *store,
                     timeout=300)
    assert answer.returncode == 0, answer.stderr
    first = answer.stdout.splitlines()[0]
    assert first.startswith("1. score 0.") and "Ops > Backups" in first
    missing = run_cli("rag", "query", "x", "--collection", "nope", "--qdrant-path",
                      str(tmp_path / "cli-store"), timeout=300)
    assert missing.returncode == 1 and "collection 'nope' does not exist" in missing.stderr


def test_a_long_question_is_cut_for_retrieval_only(embedder: Embedder) -> None:
    """Chunks must fit (an error otherwise); a question is cut at the model's limit."""
    question = "backups " * 400
    with pytest.raises(ValueError, match="more than the embedding model's 256"):
        embedder.embed([question])
    ids = embedder.tokenizer(question)["input_ids"]
    kept = [*ids[:255], ids[-1]]  # the first 254 tokens between [CLS] and [SEP]
    expected = embedder.engine.embed([kept])[0].tolist()
    assert embedder.embed([question], truncate=True)[0] == pytest.approx(expected, abs=1e-6)
