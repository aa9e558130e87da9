"""`pagellm serve`'s LoRA flags (vLLM's, plus the runtime allow-list) and their settings;
kept apart from the routes so that parsing flags imports no engine."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from pagellm.logger import init_logger
from pagellm.lora.adapter_config import check_adapter_config

logger = init_logger(__name__)
RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModule:
    """`name=path`, or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}`."""
    if value.lstrip().startswith("{"):
        try:
            spec = json.loads(value)
            return LoRAModule(spec["name"], spec["path"], spec.get("base_model_name"))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(
                f"expected JSON with name and path (and base_model_name), got {value!r}") from None
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {value!r}")
    return LoRAModule(name, path)


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=[],
                        metavar="NAME=PATH", help="LoRA adapters to serve from the start (with "
                        "--enable-lora): name=path, or JSON {\"name\", \"path\", "
                        "\"base_model_name\"}; a request selects one by its model name")
    parser.add_argument("--enable-runtime-lora-updating", action="store_true",
                        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                             f"(also env {RUNTIME_UPDATING_ENV}=True); they read adapters only "
                             "under --lora-allowed-dirs")
    parser.add_argument("--lora-allowed-dirs", nargs="+", default=[], metavar="DIR",
                        help="folders whose adapters runtime loading may read (pagellm "
                             "extension; none: runtime loading reads nothing)")


@dataclass
class LoRAServerSettings:
    modules: list[LoRAModule] = field(default_factory=list)
    runtime_updating: bool = False
    allowed_dirs: list[Path] = field(default_factory=list)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "LoRAServerSettings":
        env = os.environ.get(RUNTIME_UPDATING_ENV, "").lower() in ("1", "true")
        settings = cls(list(args.lora_modules), args.enable_runtime_lora_updating or env,
                       [Path(d).expanduser().resolve() for d in args.lora_allowed_dirs])
        if (settings.modules or settings.runtime_updating) and not args.enable_lora:
            raise ValueError("--lora-modules and runtime LoRA updating need --enable-lora.")
        for module in settings.modules:  # before the engine starts: a bad one fails in a second
            check_adapter_config(module.path)
        if settings.runtime_updating and not settings.allowed_dirs:
            logger.warning("Runtime LoRA updating is on but --lora-allowed-dirs is not set: "
                           "every load will be refused.")
        return settings
