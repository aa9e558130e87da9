"""Prompt logprobs: the model's log-softmax at prompt positions, scoring each next token.

The runner hands over the final hidden states of the positions a step scores (a chunk of
chunked prefill scores its own positions; the target of its last one is the first token of
the next chunk, known from the prompt). They go through the LM head a bounded number of
rows at a time, so that a long prompt never holds `[prompt, vocab]` logits at once, and each
row's logits do not depend on the rest of the step. Log-softmax is taken in float32, like
the sampled tokens' logprobs (raw model output, before any sampling option).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagellm.sample.metadata import LogprobMetadata
from pagellm.logprobs import TokenLogprobs
from pagellm.sample.sampler import compute_logprobs

if TYPE_CHECKING:
    from pagellm.core.sched_output import SchedulerOutput

# LM-head rows per call (24 MiB of float32 logits over SmolLM2's 49152 tokens, 77 MiB over a
# 150k vocabulary); a constant, so that every rank of a parallel group makes the same calls
ROWS_PER_CALL = 128


def score_prompt_rows(compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
                      hidden: torch.Tensor, targets: torch.Tensor,
                      num_top: list[int]) -> list[TokenLogprobs] | None:
    """For each row of `hidden`, the logprob and rank of its target token and its
    `num_top[row]` best tokens; None where `compute_logits` yields none (a rank of a
    parallel group other than the one that samples, which still joins every call)."""
    scored: list[TokenLogprobs] = []
    for start in range(0, hidden.shape[0], ROWS_PER_CALL):
        end = min(start + ROWS_PER_CALL, hidden.shape[0])
        logits = compute_logits(hidden[start:end])
        if logits is None:
            continue
        tops = num_top[start:end]
        rows = torch.arange(end - start, device=logits.device)
        meta = LogprobMetadata(rows=rows, row_list=list(range(end - start)), num_top=tops,
                               max_top=max(tops))
        scored.extend(compute_logprobs(logits, targets[start:end], meta))
    return scored if len(scored) == hidden.shape[0] else None


def hand_out_prompt_logprobs(step: "SchedulerOutput", scored: list[TokenLogprobs],
                             by_request: dict[str, list[TokenLogprobs]]) -> None:
    """The step's scored rows, in chunk order, to the requests that asked for them."""
    first = 0
    for item in step.scheduled:
        if item.num_scored:
            by_request[item.request.request_id] = scored[first:first + item.num_scored]
            first += item.num_scored
