"""A request owns all of its state: tokens, progress, blocks and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagellm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagellm.lora.manager import LoadedLoRA
    from pagellm.lora.request import LoRARequest
    from pagellm.logprobs import TokenLogprobs
    from pagellm.spec_decode.draft import Draft
    from pagellm.structured_outputs.manager import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def child_request_id(parent_id: str, index: int) -> str:
    """The id of the index-th sibling of a prompt sampled with n > 1 (index 0 is the parent)."""
    return parent_id if index == 0 else f"{parent_id}#{index}"


@dataclass
class Request:
    """One sequence being generated.

    `max_tokens` is resolved (never None) by the engine before the request is
    added. A request created by `n > 1` carries `parent_id` and its `index`
    among the siblings; its sampling seed stream is that index.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    parent_id: str | None = None
    index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # with sliding-window layers in groups of their own: the block tables of groups 1..
    # (HybridKVCacheManager; block_ids is group 0's)
    group_block_ids: list[list[int]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    swapped_block_ids: list[int] = field(default_factory=list)  # tier-2 blocks while swapped out
    grammar: "RequestGrammar | None" = None  # set by the engine core for structured outputs
    draft: "Draft | None" = None  # speculative decoding: tokens proposed for the next step
    lora_request: "LoRARequest | None" = None  # the adapter asked for; None: the base model
    lora: "LoadedLoRA | None" = None  # set by the engine core: that adapter's weights
    # prompt logprobs: entries for prompt tokens 1.. (position p's logits score token p + 1),
    # kept across preemption so that a recompute neither repeats nor loses one
    prompt_logprobs: "list[TokenLogprobs]" = field(default_factory=list)
    # leading tokens whose KV sits in shared prefix-cache blocks this request computes again
    # for their prompt logprobs: the runner must not write those slots (see KVCacheManager)
    num_kv_reused_tokens: int = 0

    @property
    def lora_key(self) -> int:
        """The integer the scheduler counts adapters by (one per adapter content); 0: none."""
        return self.lora.key if self.lora is not None else 0

    @property
    def lora_hash(self) -> bytes | None:
        """The adapter's content hash, a key of the request's prefix-cache block hashes."""
        return self.lora.content_hash if self.lora is not None else None

    @property
    def schedulable(self) -> bool:
        """False while the request's grammar is still compiling."""
        return self.grammar is None or self.grammar.ready

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.all_token_ids.extend(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def first_unscored_position(self) -> int:
        """The first prompt position whose logits prompt logprobs still need; the last
        prompt position (whose logits sample) when none is owed or none was asked for."""
        if self.sampling_params.prompt_logprobs is None or self.parent_id is not None:
            return self.num_prompt_tokens - 1
        return len(self.prompt_logprobs)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
