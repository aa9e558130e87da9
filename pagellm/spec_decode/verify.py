"""The target's side of a step with drafts, inside the model runner.

A request with d draft tokens runs 1 + d tokens (its last token and the drafts) in the
step's one forward and samples at each of them: row i is sampled as the request would be
sampled had the first i draft tokens already been accepted (its output so far extended by
them, for penalties, min_tokens and a seeded row's noise; its grammar after them). Then
`verify_drafts` turns the d + 1 sampled tokens into the tokens the step emits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagellm.core.sched_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pagellm.sample.metadata import LogprobMetadata, SamplingMetadata, SamplingRow
from pagellm.sample.sampler import Sampler, compute_logprobs, filter_random
from pagellm.spec_decode.rejection_sampler import (accept_matching, rejection_sample,
                                                   seeded_generator)

_VERIFY = 0  # told apart from the draft model's seeded draws


def draft_sampling_rows(item: ScheduledRequest) -> list[SamplingRow]:
    """One row per verified position of `item`: its last token and each draft token."""
    request = item.request
    draft = request.draft
    grammars = draft.grammars
    return [SamplingRow(params=request.sampling_params, prompt_token_ids=request.prompt_token_ids,
                        output_token_ids=request.output_token_ids + draft.token_ids[:position],
                        eos_token_id=request.eos_token_id, seed_stream=request.index,
                        grammar=grammars[position] if grammars is not None else None)
            for position in range(item.num_draft_tokens + 1)]


def verify_drafts(step: SchedulerOutput, output: ModelRunnerOutput, logits: Tensor,
                  metadata: SamplingMetadata, generator: torch.Generator | None) -> None:
    """Replace each drafting request's d + 1 sampled tokens (and logprobs) in `output` by the
    tokens its step emits: accepted drafts, then a recovered or bonus token."""
    first_row = 0
    probs: Tensor | None = None
    for item in step.scheduled:
        if not item.samples:
            continue
        request = item.request
        d = item.num_draft_tokens
        if d:
            draft = request.draft.token_ids[:d]
            sampled = output.sampled[request.request_id]
            if request.draft.probs is None or request.sampling_params.greedy:
                tokens = accept_matching(sampled, draft)
                del output.logprobs[request.request_id][len(tokens):]
            else:
                if probs is None:
                    probs = _target_probs(logits, metadata)
                tokens = _rejection_sample(item, probs, first_row, metadata, generator)
                output.logprobs[request.request_id] = _logprobs(item, logits, first_row, tokens)
            output.sampled[request.request_id] = tokens
        first_row += item.num_samples + d


def _target_probs(logits: Tensor, metadata: SamplingMetadata) -> Tensor:
    """[rows, V] probabilities every row samples from; only the random rows are filled."""
    random = metadata.random
    processed = Sampler.process_logits(logits, metadata)
    subset = processed if random.rows is None else processed.index_select(0, random.rows)
    filtered = filter_random(subset, random).softmax(dim=-1)
    if random.rows is None:
        return filtered
    return filtered.new_zeros(logits.shape).index_copy_(0, random.rows, filtered)


def _row_generator(item: ScheduledRequest, generator: torch.Generator | None,
                   device: torch.device) -> torch.Generator | None:
    """A seeded request's own generator, a pure function of (seed, sibling, step)."""
    request = item.request
    seed = request.sampling_params.seed
    if seed is None:
        return generator
    return seeded_generator(seed, (request.index, request.num_output_tokens, _VERIFY), device)


def _rejection_sample(item: ScheduledRequest, probs: Tensor, first_row: int,
                      metadata: SamplingMetadata,
                      generator: torch.Generator | None) -> list[int]:
    draft = item.request.draft
    d = item.num_draft_tokens
    target = probs[first_row:first_row + d + 1]
    draft_probs = draft.probs[:d].to(target.device, target.dtype)
    return rejection_sample(target, draft_probs, draft.token_ids[:d],
                            _row_generator(item, generator, target.device))


def _logprobs(item: ScheduledRequest, logits: Tensor, first_row: int,
              tokens: list[int]) -> list:
    """Logprobs of the emitted tokens from the raw logits of their rows, when asked for."""
    num_top = item.request.sampling_params.logprobs
    if num_top is None:
        return [None] * len(tokens)
    rows = list(range(len(tokens)))
    meta = LogprobMetadata(rows=torch.tensor(rows, device=logits.device), row_list=rows,
                           num_top=[num_top] * len(tokens), max_top=num_top)
    chosen = torch.tensor(tokens, dtype=torch.long, device=logits.device)
    return compute_logprobs(logits[first_row:first_row + len(tokens)], chosen, meta)
