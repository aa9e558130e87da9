"""The embedded SmolLM2 GGUF in float32, loaded once per session (fixtures in conftest.py).

Several files compare pagellm against the float32 dequantized file: test_models.py and
test_batch_invariance.py against transformers' model of it (about 5 s to build, and 2 s
per greedy answer of 24 tokens, two of which both files ask for), test_models.py and
test_quantized.py against pagellm's own float32 load (about 5 s, three times). Each was
built again in each test; now each is built once, and transformers' greedy answers are
kept per prompt. The tests read them and never change them (a test that needs another
dtype or attached weights changes a copy); their weights are freed after the last test
that uses them (last_use.py).
"""

from __future__ import annotations

from transformers import PreTrainedModel


class TransformersReference:
    """transformers' float32 model of the file, the config it parsed, and its greedy
    answers, computed once per (prompt, steps)."""

    def __init__(self, model: PreTrainedModel, config: dict) -> None:
        self.model, self.config = model, config
        self._answers: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(self, ids: list[int], steps: int) -> list[int]:
        """`reference_greedy(self.model, ids, steps)`, from the cache when asked before."""
        from test_models import reference_greedy

        key = (tuple(ids), steps)
        if key not in self._answers:
            self._answers[key] = reference_greedy(self.model, ids, steps)
        return list(self._answers[key])

    def release(self) -> None:
        """Frees the model (after its last test)."""
        self.model = None
        self._answers.clear()
