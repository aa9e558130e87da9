"""Retrieval quality and speed of `pagellm rag` on pagellm's own documentation.

    python benchmarks/rag_retrieval.py                  # everything (a few minutes on 2 cores)
    python benchmarks/rag_retrieval.py --e2e 0 --throughput-texts 0   # retrieval only

The corpus is docs/ (without the generated reference pages and rag.md); the questions, each
labelled with the section that answers it and a fact the answer must contain, are in
benchmarks/data/rag_questions.json. A chunk is relevant when it comes from that
section (same file, same last heading). It prints:
- Recall@1/3/5 and MRR@10, with and without breadcrumb prefixes, dense alone and dense
  fused with BM25 (bm25s, reciprocal-rank fusion), and query latency p50/p95;
- embedding throughput in texts/s, pagellm's pooling engine against
  sentence-transformers on the same texts and batch;
- end to end: for the first --e2e questions, how many answers of the embedded LLM
  contain the labelled fact with and without the retrieved context.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pagellm.rag.chunking import Chunk  # noqa: E402
from pagellm.rag.embedder import Embedder  # noqa: E402
from pagellm.rag.ingest import chunk_file, find_files, point_id  # noqa: E402
from pagellm.rag.retriever import with_context  # noqa: E402
from pagellm.rag.store import Hit, StoreSettings, VectorStore  # noqa: E402

_RRF_K = 60  # reciprocal-rank fusion's usual constant
_DEPTH = 10


@dataclass
class Question:
    question: str
    source: str
    section: str
    fact: str


@dataclass
class Variant:
    name: str
    chunks: list[Chunk]
    store: VectorStore
    collection: str
    bm25: object | None = None


def load_questions(path: Path) -> list[Question]:
    return [Question(**item) for item in json.loads(path.read_text())]


def is_relevant(question: Question, source: str, breadcrumb: str) -> bool:
    return source == question.source and breadcrumb.split(" > ")[-1] == question.section


def corpus_files(docs: Path) -> list[Path]:
    """docs/ without the generated reference pages, and without rag.md, whose examples
    quote questions of the benchmark."""
    return [p for p in find_files([str(docs)])
            if "reference" not in p.relative_to(docs).parts and p.name != "rag.md"]


def build_variant(name: str, files: list[Path], embedder: Embedder,
                  breadcrumbs: bool) -> Variant:
    chunks = [chunk for path in files for chunk in chunk_file(path, embedder, breadcrumbs)]
    store = VectorStore(StoreSettings(path=":memory:"))
    store.ensure_collection(name, embedder.dimensions)
    vectors = embedder.embed([chunk.embedded_text for chunk in chunks])
    by_source: dict[str, list[int]] = {}
    for position, chunk in enumerate(chunks):
        by_source.setdefault(chunk.source, []).append(position)
    for source, positions in by_source.items():
        store.replace_source(name, source, [point_id(source, chunks[i].index) for i in positions],
                             [vectors[i] for i in positions],
                             [{"page_content": chunks[i].text, "metadata": chunks[i].metadata}
                              for i in positions])
    variant = Variant(name, chunks, store, name)
    import bm25s

    variant.bm25 = bm25s.BM25()
    variant.bm25.index(bm25s.tokenize([c.embedded_text for c in chunks], stopwords="en",
                                      show_progress=False), show_progress=False)
    return variant


def dense(variant: Variant, embedder: Embedder, query: str, depth: int) -> list[tuple[str, str]]:
    hits: list[Hit] = variant.store.query(variant.collection, embedder.embed([query])[0], depth)
    return [(hit.source, hit.breadcrumb) for hit in hits]


def hybrid(variant: Variant, embedder: Embedder, query: str, depth: int) -> list[tuple[str, str]]:
    """Reciprocal-rank fusion of the dense ranking and BM25's, both to 5 x depth."""
    import bm25s

    wide = depth * 5
    scores: dict[tuple[str, str, int], float] = {}
    hits = variant.store.query(variant.collection, embedder.embed([query])[0], wide)
    for rank, hit in enumerate(hits):
        key = (hit.source, hit.breadcrumb, hit.metadata["chunk_index"])
        scores[key] = scores.get(key, 0.0) + 1 / (_RRF_K + rank + 1)
    tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
    found, _ = variant.bm25.retrieve(tokens, k=min(wide, len(variant.chunks)),
                                     show_progress=False)
    for rank, position in enumerate(found[0]):
        chunk = variant.chunks[int(position)]
        key = (chunk.source, chunk.breadcrumb, chunk.index)
        scores[key] = scores.get(key, 0.0) + 1 / (_RRF_K + rank + 1)
    best = sorted(scores, key=lambda key: -scores[key])[:depth]
    return [(source, breadcrumb) for source, breadcrumb, _ in best]


def evaluate(questions: list[Question], search, label: str) -> None:
    recall = {1: 0, 3: 0, 5: 0}
    reciprocal, latencies = 0.0, []
    for question in questions:
        start = time.perf_counter()
        ranked = search(question.question)
        latencies.append(time.perf_counter() - start)
        first = next((rank for rank, (source, crumb) in enumerate(ranked, 1)
                      if is_relevant(question, source, crumb)), None)
        for k in recall:
            recall[k] += first is not None and first <= k
        reciprocal += 1 / first if first else 0.0
    n = len(questions)
    latencies.sort()
    p95 = latencies[min(n - 1, int(0.95 * n))]
    print(f"{label:<28} R@1 {recall[1] / n:.3f}  R@3 {recall[3] / n:.3f}  "
          f"R@5 {recall[5] / n:.3f}  MRR@10 {reciprocal / n:.3f}  "
          f"latency p50 {statistics.median(latencies) * 1e3:.1f} ms  p95 {p95 * 1e3:.1f} ms")


def throughput(embedder: Embedder, texts: list[str], batch: int) -> None:
    from sentence_transformers import SentenceTransformer

    ids = [embedder.tokenizer(t)["input_ids"] for t in texts]
    embedder.engine.embed(ids[:batch])  # warm
    start = time.perf_counter()
    embedder.engine.embed(ids)
    ours = len(texts) / (time.perf_counter() - start)
    st = SentenceTransformer(embedder.model, device="cpu")
    st.encode(texts[:batch], batch_size=batch)
    start = time.perf_counter()
    st.encode(texts, batch_size=batch)
    theirs = len(texts) / (time.perf_counter() - start)
    print(f"embeddings, {len(texts)} chunk texts: pagellm {ours:.1f} texts/s (tokenized "
          f"beforehand, micro-batches by length), sentence-transformers {theirs:.1f} texts/s "
          f"(batch_size {batch}, tokenizing included)")


def end_to_end(questions: list[Question], variant: Variant, embedder: Embedder,
               max_tokens: int) -> None:
    from pagellm import LLM, SamplingParams

    llm = LLM(dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    plain, augmented = [], []
    for question in questions:
        body = {"messages": [{"role": "user", "content": question.question}]}
        hits = variant.store.query(variant.collection, embedder.embed([question.question])[0], 3)
        plain.append(body["messages"])
        augmented.append(with_context(body, hits)["messages"])
    answers = {name: [out.outputs[0].text for out in llm.chat(convs, params, use_tqdm=False)]
               for name, convs in (("without", plain), ("with", augmented))}
    for name, texts in answers.items():
        hits = sum(q.fact.lower() in text.lower() for q, text in zip(questions, texts))
        print(f"end to end, {len(questions)} questions, {name} retrieval: {hits} answers "
              "contain the labelled fact")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=Path, default=REPO / "docs")
    parser.add_argument("--questions", type=Path,
                        default=REPO / "benchmarks" / "data" / "rag_questions.json")
    parser.add_argument("--embedding-model", default=None)
    parser.add_argument("--e2e", type=int, default=20, help="questions asked end to end")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--throughput-texts", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    questions = load_questions(args.questions)
    embedder = Embedder(args.embedding_model)
    files = corpus_files(args.docs)
    with_crumbs = build_variant("breadcrumbs", files, embedder, breadcrumbs=True)
    raw = build_variant("raw", files, embedder, breadcrumbs=False)
    labelled = {(c.source, c.breadcrumb.split(" > ")[-1]) for c in raw.chunks}
    unknown = [q.question for q in questions if (q.source, q.section) not in labelled]
    if unknown:
        raise SystemExit(f"questions labelled with a section the corpus lacks: {unknown}")
    print(f"corpus: {len(files)} files, {len(raw.chunks)} chunks; {len(questions)} questions")
    for variant in (raw, with_crumbs):
        evaluate(questions, lambda q, v=variant: dense(v, embedder, q, _DEPTH),
                 f"dense, {variant.name}")
        evaluate(questions, lambda q, v=variant: hybrid(v, embedder, q, _DEPTH),
                 f"dense+BM25, {variant.name}")
    if args.throughput_texts:
        texts = [c.embedded_text for c in with_crumbs.chunks]
        texts = (texts * (args.throughput_texts // len(texts) + 1))[:args.throughput_texts]
        throughput(embedder, texts, args.batch)
    if args.e2e:
        end_to_end(questions[:args.e2e], with_crumbs, embedder, args.max_tokens)


if __name__ == "__main__":
    main()
