"""`pagellm` command line: the same verbs and flag names as `vllm`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pagellm.benchmarks import fidelity, throughput
from pagellm.benchmarks import serve as serve_benchmark
from pagellm.entrypoints import chat_cli
from pagellm.entrypoints.openai.cli_args import add_serve_args
from pagellm.rag import cli as rag_cli
from pagellm.router import cli as router_cli
from pagellm.model.errors import ModelLoadError


class _Parser(argparse.ArgumentParser):
    """vLLM's flag spelling rules; bad flags or values end in one line on stderr, never a traceback.

    As in vLLM, `--max_model_len` means `--max-model-len`, and a flag is never matched by a prefix
    of its name (`--max-model` is an error, not a guess)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        words = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([_dashed_flag(word) for word in words], namespace)

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _dashed_flag(word: str) -> str:
    """`--served_model_name=x_y` -> `--served-model-name=x_y`: only a long flag's name changes."""
    if not word.startswith("--"):
        return word
    name, equals, value = word.partition("=")
    return name.replace("_", "-") + equals + value


def _serve(args: argparse.Namespace) -> None:
    from pagellm.entrypoints.openai.launch import run_server

    run_server(args)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pagellm", description="Serve and benchmark LLMs with a paged KV cache.")
    verbs = parser.add_subparsers(dest="verb", metavar="{serve,router,chat,bench,rag}", parser_class=_Parser)
    serve = verbs.add_parser("serve", help="start the OpenAI-compatible API server",
                             description="Start the OpenAI-compatible API server.")
    add_serve_args(serve)
    serve.set_defaults(handler=_serve)
    router = verbs.add_parser("router", help="route requests across replicas and providers",
                              description="An OpenAI-compatible router: balances replicas by "
                                          "load and prefix, keeps customer data local.")
    router_cli.add_router_args(router)
    router.set_defaults(handler=router_cli.run)
    chat = verbs.add_parser("chat", help="chat in the terminal, with a server or in-process",
                            description="Chat in the terminal: replies stream as they are "
                                        "generated, one user message per stdin line.")
    chat_cli.add_chat_args(chat)
    chat.set_defaults(handler=chat_cli.run)
    bench = verbs.add_parser("bench", help="benchmark the engine")
    bench_kinds = bench.add_subparsers(dest="bench_kind", metavar="{throughput,serve,fidelity}",
                                       parser_class=_Parser)
    bench_throughput = bench_kinds.add_parser("throughput", help="offline output tokens/s")
    throughput.add_cli_args(bench_throughput)
    bench_throughput.set_defaults(handler=throughput.run)
    bench_serve = bench_kinds.add_parser("serve", help="load-test an OpenAI-compatible server")
    serve_benchmark.add_cli_args(bench_serve)
    bench_serve.set_defaults(handler=serve_benchmark.run)
    bench_fidelity = bench_kinds.add_parser(
        "fidelity", help="greedy answers of engine choices against the exact model")
    fidelity.add_cli_args(bench_fidelity)
    bench_fidelity.set_defaults(handler=fidelity.run)
    rag = verbs.add_parser("rag", help="retrieval-augmented generation over your documents",
                           description="Ingest documents into Qdrant, query them, serve "
                                       "retrieval for an LLM.")
    rag_cli.add_rag_args(rag, _Parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 1
    try:
        handler(args)
    except ModelLoadError as error:  # a model file that cannot be used: exit 2, as for a bad flag
        print(f"pagellm: error: {error}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as error:
        print(f"pagellm: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
