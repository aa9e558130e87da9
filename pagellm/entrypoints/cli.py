"""`pagellm` command line: the same verbs and flag names as `vllm`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

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


# Each verb's arguments come from its module, imported only where the parser is built for
# that verb (or for all): `serve` forks its engine core without first importing the
# benchmark, router, chat and RAG modules (0.4 s on a 2-core AMD EPYC, on a restart's
# critical path).
def _add_serve(serve: argparse.ArgumentParser) -> None:
    from pagellm.entrypoints.openai.cli_args import add_serve_args

    add_serve_args(serve)
    serve.set_defaults(handler=_serve)


def _add_router(router: argparse.ArgumentParser) -> None:
    from pagellm.router import cli as router_cli

    router_cli.add_router_args(router)
    router.set_defaults(handler=router_cli.run)


def _add_chat(chat: argparse.ArgumentParser) -> None:
    from pagellm.entrypoints import chat_cli

    chat_cli.add_chat_args(chat)
    chat.set_defaults(handler=chat_cli.run)


def _add_bench(bench: argparse.ArgumentParser) -> None:
    from pagellm.benchmarks import fidelity, throughput
    from pagellm.benchmarks import serve as serve_benchmark

    kinds = bench.add_subparsers(dest="bench_kind", metavar="{throughput,serve,fidelity}",
                                 parser_class=_Parser)
    for name, module, help_text in (
            ("throughput", throughput, "offline output tokens/s"),
            ("serve", serve_benchmark, "load-test an OpenAI-compatible server"),
            ("fidelity", fidelity, "greedy answers of engine choices against the exact model")):
        kind = kinds.add_parser(name, help=help_text)
        module.add_cli_args(kind)
        kind.set_defaults(handler=module.run)


def _add_rag(rag: argparse.ArgumentParser) -> None:
    from pagellm.rag import cli as rag_cli

    rag_cli.add_rag_args(rag, _Parser)


# verb: (help, description, adds its arguments)
_VERBS = {
    "serve": ("start the OpenAI-compatible API server",
              "Start the OpenAI-compatible API server.", _add_serve),
    "router": ("route requests across replicas and providers",
               "An OpenAI-compatible router: balances replicas by load and prefix, keeps "
               "customer data local.", _add_router),
    "chat": ("chat in the terminal, with a server or in-process",
             "Chat in the terminal: replies stream as they are generated, one user message "
             "per stdin line.", _add_chat),
    "bench": ("benchmark the engine", None, _add_bench),
    "rag": ("retrieval-augmented generation over your documents",
            "Ingest documents into Qdrant, query them, serve retrieval for an LLM.", _add_rag),
}


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser: every verb's arguments, or only `verb`'s (the others are
    listed, with their help, and take none)."""
    parser = _Parser(prog="pagellm", description="Serve and benchmark LLMs with a paged KV cache.")
    verbs = parser.add_subparsers(dest="verb", metavar="{serve,router,chat,bench,rag}",
                                  parser_class=_Parser)
    for name, (help_text, description, add_arguments) in _VERBS.items():
        subparser = verbs.add_parser(name, help=help_text, description=description)
        if verb is None or verb == name:
            add_arguments(subparser)
    return parser


def _verb_of(argv: Sequence[str]) -> str | None:
    """The verb a command line names: its first word not a flag (flags before it belong to
    the top-level parser, which takes none but --help)."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_verb_of(words))
    args = parser.parse_args(words)
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
