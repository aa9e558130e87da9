"""Logging in vLLM's line format, so that log scrapers and habits carry over."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"


def _configure_root() -> None:
    root = logging.getLogger("pagellm")
    if root.handlers or os.environ.get("PAGELLM_CONFIGURE_LOGGING", "1") == "0":
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt=_DATE_FORMAT))
    root.addHandler(handler)
    root.setLevel(os.environ.get("PAGELLM_LOGGING_LEVEL", "INFO"))
    root.propagate = False


def init_logger(name: str) -> logging.Logger:
    _configure_root()
    return logging.getLogger(name)


def log_to_stderr() -> None:
    """Move pagellm's log lines to stderr, for commands whose stdout is their product."""
    _configure_root()
    for handler in logging.getLogger("pagellm").handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)



def name_process_lines(name: str) -> None:
    """Head this process's log lines with its name and pid, as vLLM's `(APIServer pid=..)`,
    where several processes of one server write to the same terminal."""
    _configure_root()
    prefix = f"({name} pid={os.getpid()}) "
    for handler in logging.getLogger("pagellm").handlers:
        handler.setFormatter(logging.Formatter(prefix + _FORMAT, datefmt=_DATE_FORMAT))
