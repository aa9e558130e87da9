"""A scheduled step in integers: what every rank of a parallel group needs to run it.

The driver (rank 0) sends each step's `StepChunk`s to the other ranks, which build the very
tensors rank 0 builds from them (pagellm.distributed.executor); no request object crosses.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.core.sched_output import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class StepChunk:
    """One scheduled chunk in integers: all a rank needs to run it (no request object)."""

    token_ids: list[int]  # speculative drafts, if any, last
    start: int
    block_ids: list[int]
    num_samples: int
    num_draft_tokens: int = 0  # each draft position is sampled (verified) too
    num_kv_reused: int = 0  # leading tokens whose K/V is in shared cached blocks: not written
    score_offset: int = 0  # the first of its tokens whose logits score the next prompt token
    score_targets: tuple[int, ...] = ()  # those next prompt tokens, one per scored token
    num_prompt_logprobs: int = 0  # the top-k of each scored token
    group_block_ids: tuple[list[int], ...] = ()  # the block tables of layer groups 1..


def _chunk_tokens(item: ScheduledRequest) -> list[int]:
    request, drafts = item.request, item.num_draft_tokens
    known = request.all_token_ids[item.start:item.start + item.num_tokens - drafts]
    return known + request.draft.token_ids[:drafts] if drafts else known


def _step_chunk(item: ScheduledRequest) -> StepChunk:
    request = item.request
    reused = min(max(0, request.num_kv_reused_tokens - item.start), item.num_tokens)
    top = request.sampling_params.prompt_logprobs or 0
    return StepChunk(_chunk_tokens(item), item.start, request.block_ids, item.num_samples,
                     item.num_draft_tokens, reused, max(0, item.score_start - item.start),
                     tuple(item.score_targets), top if item.num_scored else 0,
                     tuple(request.group_block_ids))


def step_chunks(step: SchedulerOutput) -> list[StepChunk]:
    return [_step_chunk(item) for item in step.scheduled]

