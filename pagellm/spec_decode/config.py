"""`--speculative-config` as vLLM spells it, and the old flags that used to say the same."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagellm.config import parse_json_object

METHODS = ("ngram", "draft_model")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "draft_sample_method", "disable_adaptive"}
# the old flag that named the n-gram proposer instead of a model
NGRAM_MODEL_NAME = "[ngram]"


@dataclass
class SpeculativeConfig:
    """What proposes draft tokens and how many at most per request and step.

    `disable_adaptive` (pagellm's) keeps every step at `num_speculative_tokens` instead of
    letting the engine turn speculation down where it would not pay (see
    `pagellm.spec_decode.controller`); tests and measurements of the raw proposer use it.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    draft_sample_method: str = "greedy"
    disable_adaptive: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method {self.method!r} is not supported; "
                             f"pagellm has {', '.join(METHODS)}.")
        if self.num_speculative_tokens < 1:
            raise ValueError("speculative_config num_speculative_tokens must be at least 1, got "
                             f"{self.num_speculative_tokens}.")
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"speculative_config draft_sample_method must be one of "
                             f"{', '.join(DRAFT_SAMPLE_METHODS)}, got "
                             f"{self.draft_sample_method!r}.")
        if self.method == "ngram":
            self._check_ngram()
        elif not self.model:
            raise ValueError("speculative_config method 'draft_model' needs a model.")

    def _check_ngram(self) -> None:
        if self.model is not None:
            raise ValueError("speculative_config method 'ngram' takes no model.")
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            raise ValueError("speculative_config method 'ngram' needs prompt_lookup_max.")
        # as vLLM: either bound defaults to the other
        self.prompt_lookup_max = self.prompt_lookup_max or self.prompt_lookup_min
        self.prompt_lookup_min = self.prompt_lookup_min or self.prompt_lookup_max
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max, got {self.prompt_lookup_min} and "
                             f"{self.prompt_lookup_max}.")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SpeculativeConfig":
        unknown = sorted(set(values) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config has unsupported keys {unknown}; pagellm "
                             f"reads {sorted(_KEYS)}.")
        values = dict(values)
        method = values.pop("method", None)
        if method is None:  # inferred as vLLM does: a model means a draft model
            method = "draft_model" if values.get("model") else "ngram"
        if "num_speculative_tokens" not in values:
            raise ValueError("speculative_config needs num_speculative_tokens.")
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            if values.get(key) is not None and not isinstance(values[key], int):
                raise ValueError(f"speculative_config {key} must be an integer, got "
                                 f"{values[key]!r}.")
        return cls(method=method, **values)


def parse_speculative_config(config: str | dict[str, Any] | None, model: str | None = None,
                             num_tokens: int | None = None, lookup_max: int | None = None,
                             lookup_min: int | None = None) -> SpeculativeConfig | None:
    """The JSON (or, offline, a dict) of `--speculative-config`, or the old flags
    `--speculative-model` ("[ngram]" or a draft model), `--num-speculative-tokens` and
    `--ngram-prompt-lookup-max/min`; not both. None: no speculation."""
    old = {key: value for key, value in (("model", model), ("num_speculative_tokens", num_tokens),
                                          ("prompt_lookup_max", lookup_max),
                                          ("prompt_lookup_min", lookup_min)) if value is not None}
    if config is not None and old:
        raise ValueError("set either speculative_config or the old speculative flags "
                         "(speculative_model, num_speculative_tokens, ngram_prompt_lookup_*), "
                         "not both.")
    if config is None:
        if not old:
            return None
        if old.get("model") == NGRAM_MODEL_NAME:
            old.pop("model")
            old["method"] = "ngram"
        return SpeculativeConfig.from_dict(old)
    if isinstance(config, str):
        config = parse_json_object(config, "speculative_config")
    if not isinstance(config, dict):
        raise ValueError("speculative_config must be a JSON object.")
    return SpeculativeConfig.from_dict(config)
