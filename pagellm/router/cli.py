"""`pagellm router`: flags, and the config they build when there is no `--config` file."""

from __future__ import annotations

import argparse

import httpx
import uvicorn

from pagellm.logger import init_logger
from pagellm.router.config import (BALANCING_POLICIES, BackendConfig, GroupConfig, RouterConfig,
                                   load_config)

logger = init_logger(__name__)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="router YAML: groups, models, rules, privacy "
                                         "(see docs/router.md)")
    parser.add_argument("--backend", action="append", default=[], metavar="URL",
                        help="a local replica, e.g. http://10.0.0.1:8000 (repeat for each); "
                             "all serve one model")
    parser.add_argument("--served-model-name", help="the replicas' model name (default: the "
                                                    "first one the first backend lists)")
    parser.add_argument("--routing-logic", "--balancing", dest="balancing", default="prefix",
                        choices=BALANCING_POLICIES, help="how replicas are chosen")
    parser.add_argument("--session-key", default="x-session-id",
                        help="header for --routing-logic session")
    parser.add_argument("--block-size", type=int, default=16,
                        help="the replicas' KV block size, for prefix routing")
    parser.add_argument("--host", default=None, help="default 127.0.0.1")
    parser.add_argument("--port", type=int, default=None, help="default 8080")
    parser.add_argument("--probe-interval", type=float, default=None,
                        help="seconds between /health and /metrics probes (default 1)")
    parser.add_argument("--uvicorn-log-level", default="warning")


def _first_model(url: str) -> str:
    backend = BackendConfig(url)
    try:
        models = httpx.get(f"{backend.url}/models", timeout=10).json()["data"]
        return str(models[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as error:
        raise ValueError(f"cannot read the model name from {backend.url}/models ({error}); "
                         f"pass --served-model-name") from None


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    if args.config and args.backend:
        raise ValueError("give either --config or --backend, not both")
    if args.config:
        config = load_config(args.config)
    elif args.backend:
        name = args.served_model_name or _first_model(args.backend[0])
        backends = [BackendConfig(url, local=True) for url in args.backend]
        group = GroupConfig(name, backends, balancing=args.balancing,
                            session_header=args.session_key, block_size=args.block_size)
        config = RouterConfig(groups={name: group})
    else:
        raise ValueError("give --config router.yaml or at least one --backend URL")
    for flag, attribute in (("host", "host"), ("port", "port"),
                            ("probe_interval", "probe_interval_s")):
        if getattr(args, flag) is not None:
            setattr(config, attribute, getattr(args, flag))
    return config


def run(args: argparse.Namespace) -> None:
    from pagellm.router.app import build_app

    config = config_from_args(args)
    app = build_app(config)
    for group in config.groups.values():
        logger.info("Group %s (%s, %s): %s", group.name, "local" if group.local else "external",
                    group.balancing, ", ".join(b.name for b in group.backends))
    logger.info("Starting pagellm router on http://%s:%d for models: %s", config.host,
                config.port, ", ".join(config.public_models))
    uvicorn.run(app, host=config.host, port=config.port, log_level=args.uvicorn_log_level)
