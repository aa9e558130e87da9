"""Sampling parameters, with vLLM's names, defaults and validation."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pagellm.structured_outputs.params import StructuredOutputsParams

_MAX_N = 128
_MAX_TOP_LOGPROBS = 20


class OutputKind(enum.Enum):
    """What a request's outputs carry (vLLM's RequestOutputKind)."""

    CUMULATIVE = "cumulative"  # every step, the whole output so far
    DELTA = "delta"  # every step, only what is new (streaming)
    FINAL_ONLY = "final_only"  # once, when all n sequences are done


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-k per prompt token (and the token itself)
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._validate()

    def _validate(self) -> None:
        checks = [
            (1 <= self.n <= _MAX_N, f"n must be between 1 and {_MAX_N}, got {self.n}."),
            (-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}."),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}."),
            (self.repetition_penalty > 0.0,
             f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."),
            (self.temperature >= 0.0,
             f"temperature must be non-negative, got {self.temperature}."),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}."),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}."),
            (self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be at least 1, got {self.max_tokens}."),
            (self.min_tokens >= 0, f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
             f"got {self.min_tokens}."),
            (self.logprobs is None or 0 <= self.logprobs <= _MAX_TOP_LOGPROBS,
             f"logprobs must be between 0 and {_MAX_TOP_LOGPROBS}, got {self.logprobs}."),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= _MAX_TOP_LOGPROBS,
             f"prompt_logprobs must be between 0 and {_MAX_TOP_LOGPROBS}, "
             f"got {self.prompt_logprobs}."),
            (all(s for s in self.stop), "stop strings must not be empty."),
            (not (self.ignore_eos and self.structured_outputs),
             "ignore_eos cannot be combined with structured outputs: the output would go on "
             "unconstrained after the grammar's end."),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self) -> "SamplingParams":
        data = {f: getattr(self, f) for f in self.__dataclass_fields__}
        return SamplingParams(**data)
