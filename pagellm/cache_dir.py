"""pagellm's cache folder (GGUF tokenizers, prepared weights, the default Qdrant store), in
a module that imports neither torch nor transformers: `pagellm rag` finds its store before
anything heavy is loaded."""

from __future__ import annotations

import os
from pathlib import Path


def pagellm_cache_dir() -> Path:
    """$PAGELLM_CACHE_DIR, else pagellm/ under $XDG_CACHE_HOME or ~/.cache."""
    if os.environ.get("PAGELLM_CACHE_DIR"):
        return Path(os.environ["PAGELLM_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagellm"
