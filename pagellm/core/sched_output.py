"""What the scheduler decides for one step and what comes back from it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from pagellm.core.block_map import BlockMap
from pagellm.request import Request
from pagellm.logprobs import TokenLogprobs
from pagellm.spec_decode.metrics import SpecDecodingStats

if TYPE_CHECKING:
    from pagellm.lora.metrics import LoRAStats


@dataclass(frozen=True)
class ScheduledRequest:
    """`num_tokens` of `request` from position `start` run this step; fixed when scheduled.
    The last `num_draft_tokens` of them are the first tokens of `request.draft` (speculative
    decoding), each verified by a sample of its own. With prompt logprobs, the logits of the
    `num_scored` positions from `score_start` score the prompt token after each."""

    request: Request
    num_tokens: int
    start: int
    num_samples: int
    num_draft_tokens: int = 0
    score_start: int = 0
    num_scored: int = 0

    @classmethod
    def for_chunk(cls, request: Request, num_tokens: int,
                  num_draft_tokens: int = 0) -> "ScheduledRequest":
        """A chunk reaching the last known token samples; a prompt with n > 1 samples n
        first tokens from one set of logits, one per sibling."""
        start = request.num_computed_tokens
        samples = start + num_tokens - num_draft_tokens == request.num_tokens
        forks = (request.sampling_params.n > 1 and request.parent_id is None
                 and request.num_output_tokens == 0)
        num_samples = (request.sampling_params.n if forks else 1) if samples else 0
        last_prompt = request.num_prompt_tokens - 1
        unscored = request.first_unscored_position
        assert unscored >= min(start, last_prompt), "a chunk skips positions still to score"
        score_start = max(start, unscored)
        num_scored = max(0, min(start + num_tokens, last_prompt) - score_start)
        return cls(request, num_tokens, start, num_samples, num_draft_tokens,
                   score_start if num_scored else 0, num_scored)

    @property
    def score_targets(self) -> list[int]:
        """The prompt tokens the scored positions' logits score (each position's next)."""
        first = self.score_start + 1
        return self.request.prompt_token_ids[first:first + self.num_scored]

    @property
    def samples(self) -> bool:
        return self.num_samples > 0


@dataclass
class SchedulerOutput:
    """The step's chunks, and the block copies between the KV tiers that precede its forward:
    `kv_stores` as (tier-1, tier-2) block pairs, then `kv_loads` as (tier-2, tier-1) pairs."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    kv_stores: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute (there may still be transfers)."""
        return not self.scheduled

    @property
    def has_drafts(self) -> bool:
        return any(s.num_draft_tokens for s in self.scheduled)

    @property
    def has_transfers(self) -> bool:
        return bool(self.kv_stores or self.kv_loads)


@dataclass
class KVTransferStats:
    """Copies between the KV tiers: one step's from the runner, summed over the run in stats.
    A store (or load) is one batched copy of all of a step's store (or load) pairs."""

    num_stores: int = 0
    stored_blocks: int = 0
    store_bytes: int = 0
    store_seconds: float = 0.0
    num_loads: int = 0
    loaded_blocks: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0

    def add(self, other: "KVTransferStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def since(self, earlier: "KVTransferStats") -> "KVTransferStats":
        """The difference of two cumulative records."""
        return KVTransferStats(*(getattr(self, f.name) - getattr(earlier, f.name)
                                 for f in fields(self)))


@dataclass
class ModelRunnerOutput:
    """Sampled tokens per request id (n tokens for a prompt that forks), logprobs alike."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    transfers: KVTransferStats = field(default_factory=KVTransferStats)
    # per request id, the prompt logprobs of this step's scored positions, in order
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


@dataclass
class RequestUpdate:
    """New tokens of one sequence after a step: a small record that crosses processes."""

    request_id: str
    parent_id: str | None
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # with a request's first token: its prompt logprobs, for prompt tokens 1.. (0 has none)
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class OffloadStats:
    """The second KV tier: usage now (0-1), its size, and the transfers so far (cumulative)."""

    usage: float
    allocation_bytes: int
    transfers: KVTransferStats


@dataclass
class SchedulerStats:
    """A small record per step for the loggers. Counters are cumulative; loggers take deltas."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    offload: OffloadStats | None = None  # None when there is no second KV tier
    block_map: BlockMap | None = None  # the engine view's picture, at most once a second
    spec_decoding: SpecDecodingStats | None = None  # None without speculative decoding
    lora: "LoRAStats | None" = None  # with --enable-lora
    # pipeline parallelism (the engine core's batch queue): the batches in flight after this
    # step launched one; cumulative: the batches launched, and those launched while another
    # was in flight (so the stages computed them at once)
    batches_in_flight: int = 0
    num_batches: int = 0
    num_overlapped_batches: int = 0

