"""`pagellm serve` flags (vLLM's names) and the settings derived from them."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from pagellm.distributed.config import add_parallel_cli_args
from pagellm.chat_template import load_chat_template
from pagellm.engine.arg_utils import EngineArgs
from pagellm.entrypoints.openai.lora_args import LoRAServerSettings, add_lora_args

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
API_KEY_ENV_VARS = ("PAGELLM_API_KEY", "VLLM_API_KEY")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20  # far above any prompt a model's context holds
DEFAULT_SHUTDOWN_TIMEOUT = 30.0  # Kubernetes' default termination grace period
DEFAULT_RESPONSES_STORE_SIZE = 1000


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {port}")
    return port


def _json_list(value: str) -> list[str]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return parsed


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _non_negative_float(value: str) -> float:
    number = float(value)
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return number


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
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="read the API key from this file (keeps it out of `ps`)")
    parser.add_argument("--enable-metrics-auth", action="store_true",
                        help="/metrics needs the API key too (/health and /version never do)")
    parser.add_argument("--disable-fastapi-docs", action="store_true",
                        help="do not serve /docs, /redoc and /openapi.json")
    parser.add_argument("--allowed-origins", type=_json_list, default=None, metavar="JSON",
                        help='CORS: origins allowed, a JSON list such as \'["https://a.example"]\' '
                             "(default: no CORS headers at all)")
    parser.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                        help="CORS: methods allowed (with --allowed-origins)")
    parser.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                        help="CORS: headers allowed (with --allowed-origins)")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="CORS: allow credentials (with --allowed-origins)")
    parser.add_argument("--ssl-keyfile", default=None, help="TLS private key file (PEM)")
    parser.add_argument("--ssl-certfile", default=None, help="TLS certificate file (PEM)")
    parser.add_argument("--max-concurrent-requests", type=_positive_int, default=None,
                        metavar="N", help="answer 429 to API requests beyond N in flight "
                                          "(default: no limit)")
    parser.add_argument("--max-request-body-bytes", type=_positive_int,
                        default=DEFAULT_MAX_REQUEST_BODY_BYTES, metavar="BYTES",
                        help="answer 413 to a request body larger than this, checked while "
                             f"reading (default {DEFAULT_MAX_REQUEST_BODY_BYTES})")
    parser.add_argument("--shutdown-timeout", type=_non_negative_float,
                        default=DEFAULT_SHUTDOWN_TIMEOUT, metavar="SECONDS",
                        help="on SIGTERM, how long in-flight requests may run before they are "
                             f"ended (default {DEFAULT_SHUTDOWN_TIMEOUT:g})")
    parser.add_argument("--responses-store-size", type=int, default=DEFAULT_RESPONSES_STORE_SIZE,
                        metavar="N",
                        help="finished /v1/responses kept for previous_response_id and GET, "
                             "least recently used out first; 0 keeps none "
                             f"(default {DEFAULT_RESPONSES_STORE_SIZE})")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="do not log each received request")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="do not log the periodic engine stats line")
    parser.add_argument("--disable-frontend", action="store_true",
                        help="do not serve the web playground and engine view at /")
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
    add_lora_args(parser)
    EngineArgs.add_cli_args(parser, skip=("model", "served_model_name"))
    add_parallel_cli_args(parser)


@dataclass
class CorsSettings:
    allowed_origins: list[str]
    allowed_methods: list[str]
    allowed_headers: list[str]
    allow_credentials: bool


@dataclass
class ServerLimits:
    max_concurrent_requests: int | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    responses_store_size: int = DEFAULT_RESPONSES_STORE_SIZE


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
    api_key: str | None = field(repr=False)  # never in a log line
    log_requests: bool
    log_stats: bool
    uvicorn_log_level: str
    engine_args: EngineArgs
    frontend: bool = True
    metrics_need_key: bool = False
    docs: bool = True
    cors: CorsSettings | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    tools: ToolSettings = field(default_factory=ToolSettings)
    lora: LoRAServerSettings = field(default_factory=LoRAServerSettings)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerSettings":
        names = list(args.served_model_name or [args.model or DEFAULT_SERVED_NAME])
        lora = LoRAServerSettings.from_args(args)  # reads adapter configs only: no torch
        engine_args = EngineArgs.from_cli_args(args)
        engine_args.served_model_name = names[0]
        # Checked before the engine starts, so a bad template fails in a second, not a minute;
        # jinja2 only: the engine core is forked after this, and before torch is imported.
        engine_args.chat_template = load_chat_template(args.chat_template)
        if args.tool_parser_plugin:
            from pagellm.entrypoints.openai.tool_parsers import ToolParserManager

            ToolParserManager.load_plugin(args.tool_parser_plugin)
        engine_args.grammar_config()  # a bad --structured-outputs-config fails now
        engine_args.speculative()  # and a bad --speculative-config
        engine_args.parallel_config()  # and a parallel layout not built yet
        tools = ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser,
                             args.reasoning_parser)
        cors = None
        if args.allowed_origins is not None:
            cors = CorsSettings(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                                args.allow_credentials)
        if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
            raise ValueError("TLS needs both --ssl-keyfile and --ssl-certfile.")
        return cls(host=args.host, port=args.port, model_names=names, api_key=_api_key(args),
                   log_requests=not args.disable_log_requests,
                   log_stats=not args.disable_log_stats,
                   uvicorn_log_level=args.uvicorn_log_level, engine_args=engine_args,
                   frontend=not args.disable_frontend, tools=tools,
                   metrics_need_key=args.enable_metrics_auth,
                   docs=not args.disable_fastapi_docs, cors=cors,
                   ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                   limits=ServerLimits(args.max_concurrent_requests,
                                       args.max_request_body_bytes, args.shutdown_timeout,
                                       args.responses_store_size),
                   lora=lora)


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the first line of --api-key-file, else the environment."""
    if args.api_key:
        return args.api_key
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as error:
            raise ValueError(f"--api-key-file {args.api_key_file}: "
                             f"{error.strerror or error}") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty.")
        return key
    return next((os.environ[name] for name in API_KEY_ENV_VARS if os.environ.get(name)), None)
