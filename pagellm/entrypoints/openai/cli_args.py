"""`pagellm serve` flags (vLLM's names) and the settings derived from them."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


from pagellm.engine.arg_utils import EngineArgs

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
API_KEY_ENV_VARS = ("PAGELLM_API_KEY", "VLLM_API_KEY")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {port}")
    return port


def _tensor_parallel_size(value: str) -> int:
    size = int(value)
    if size != 1:
        raise argparse.ArgumentTypeError(
            f"pagellm runs a model on one device; only 1 is supported, got {size}")
    return size


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="local HF model folder or .gguf file "
                             "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=_port, default=8000, help="port to listen on")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="model name(s) the API answers to; the first is reported "
                             "(default: the model argument)")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on the API routes "
                             f"(also env {' or '.join(API_KEY_ENV_VARS)})")
    parser.add_argument("--tensor-parallel-size", "-tp", type=_tensor_parallel_size, default=1,
                        help="accepted for vLLM compatibility; only 1")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="do not log each received request")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="do not log the periodic engine stats line")
    parser.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="info",
                        help="log level of uvicorn (access log at info)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="parse tool calls out of answers for tool_choice 'auto' (the "
                             "default when a request has tools)")
    parser.add_argument("--tool-call-parser", default=None,
                        help="the tool-call format: hermes, mistral, llama3_json, pythonic, or "
                             "a plugin's name (default: found from the chat template)")
    parser.add_argument("--tool-parser-plugin", default=None,
                        help="a Python file that registers a tool-call parser")
    parser.add_argument("--reasoning-parser", default=None, choices=("deepseek_r1", "qwen3"),
                        help="split the model's thinking into message.reasoning")
    EngineArgs.add_cli_args(parser, skip=("model", "served_model_name"))


@dataclass
class ToolSettings:
    """What `pagellm serve` was told about tools and reasoning."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


@dataclass
class ServerSettings:
    host: str
    port: int
    model_names: list[str]
    api_key: str | None
    log_requests: bool
    log_stats: bool
    uvicorn_log_level: str
    engine_args: EngineArgs
    tools: ToolSettings

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerSettings":
        names = list(args.served_model_name or [args.model or DEFAULT_SERVED_NAME])
        engine_args = EngineArgs.from_cli_args(args)
        engine_args.served_model_name = names[0]
        # Checked before the engine starts, so a bad template fails in a second, not a minute.
        from pagellm.tokenizer import load_chat_template  # transformers: only when serving

        engine_args.chat_template = load_chat_template(args.chat_template)
        if args.tool_parser_plugin:
            from pagellm.entrypoints.openai.tool_parsers import ToolParserManager

            ToolParserManager.load_plugin(args.tool_parser_plugin)
        engine_args.grammar_config()  # a bad --structured-outputs-config fails now
        tools = ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser,
                             args.reasoning_parser)
        api_key = args.api_key or next(
            (os.environ[name] for name in API_KEY_ENV_VARS if os.environ.get(name)), None)
        return cls(host=args.host, port=args.port, model_names=names, api_key=api_key,
                   log_requests=not args.disable_log_requests,
                   log_stats=not args.disable_log_stats,
                   uvicorn_log_level=args.uvicorn_log_level, engine_args=engine_args,
                   tools=tools)
