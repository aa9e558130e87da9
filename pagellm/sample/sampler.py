"""Batched sampler: every stage is tensor math over [rows, vocab].

Order follows vLLM: raw logprobs; min-tokens mask and logit bias; penalties;
greedy argmax; then, for random rows only, temperature, min_p, top-k/top-p and
the exponential race argmax(probs / q), q ~ Exp(1), computed as
argmax(logits - log q) so no softmax is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from pagellm.logprobs import TokenLogprobs
from pagellm.kernels import apply_token_bitmask, argmax_rows, use_cpu_kernels
from pagellm.sample.metadata import (
    LogprobMetadata,
    PenaltyMetadata,
    RandomMetadata,
    SamplingMetadata,
    SamplingRow,
    SparseLogitEdit,
    TokenMaskMetadata,
    build_sampling_metadata,
)
from pagellm.sample.noise import random_row_keys, subtract_noise_

__all__ = ["Sampler", "SamplerOutput", "SamplingRow", "build_sampling_metadata"]

_NEG_INF = float("-inf")
# How many of the best logits to search for the top-p nucleus before a full sort.
_TOP_P_CANDIDATES = 1024


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where params.logprobs is None


def _on_rows(logits: Tensor, rows: Tensor | None, fn: Callable[[Tensor], Tensor]) -> Tensor:
    if rows is None:
        return fn(logits)
    return logits.index_copy(0, rows, fn(logits.index_select(0, rows)))


def _apply_edit(logits: Tensor, edit: SparseLogitEdit, accumulate: bool) -> Tensor:
    return logits.index_put((edit.rows, edit.tokens), edit.values, accumulate=accumulate)


def _token_counts(tokens: Tensor, vocab_size: int) -> Tensor:
    """[rows, vocab] occurrence counts of `tokens` [rows, L] padded with vocab_size."""
    real = tokens < vocab_size
    counts = torch.zeros(tokens.shape[0], vocab_size, dtype=torch.float32, device=tokens.device)
    return counts.scatter_add_(1, tokens.masked_fill(~real, 0), real.to(torch.float32))


def apply_token_mask(logits: Tensor, mask: TokenMaskMetadata, in_place: bool = False) -> Tensor:
    """Disallowed tokens of the constrained rows to -inf. `in_place`: `logits` is the sampler's
    own copy and may be written. The CPU kernel tests each bit as it copies its logit; the
    torch path (no kernels) unpacks the bitmask to [G, vocab] first."""
    if (use_cpu_kernels(logits) and logits.dim() == 2 and logits.is_contiguous()
            and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        out = logits if in_place else torch.empty_like(logits)
        apply_token_bitmask(logits, mask.bitmask, mask.rows, out)
        return out
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = mask.bitmask.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and_(1)
    allowed = bits.view(bits.shape[0], -1)[:, :logits.shape[1]].bool()
    return _on_rows(logits, mask.rows, lambda rows: rows.masked_fill(~allowed, _NEG_INF))


def apply_penalties(logits: Tensor, meta: PenaltyMetadata) -> Tensor:
    """Repetition (prompt+output, divide positive / multiply negative), then frequency and presence (output)."""
    vocab_size = logits.shape[1]
    counts = _token_counts(meta.output_tokens, vocab_size)
    present = counts > 0
    if meta.repetition is not None and meta.prompt_tokens is not None:
        seen = present | (_token_counts(meta.prompt_tokens, vocab_size) > 0)
        factor = seen.to(torch.float32).mul_(meta.repetition - 1.0).add_(1.0)
        logits = logits.clamp_min(0.0).div_(factor).add_(logits.clamp_max(0.0).mul_(factor))
    return logits - counts.mul_(meta.frequency) - present.to(torch.float32).mul_(meta.presence)


def apply_min_p(logits: Tensor, min_p_log: Tensor) -> Tensor:
    """Drop tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p)."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p_log
    return logits.masked_fill(logits < threshold, _NEG_INF)


def apply_top_k(logits: Tensor, top_k: Tensor, top_k_max: int) -> Tensor:
    """Keep logits >= the k-th largest (ties at the k-th value survive); k = vocab disables."""
    values = logits.topk(top_k_max, dim=-1).values
    threshold = values.gather(1, (top_k.clamp_max(top_k_max) - 1).unsqueeze(1))
    threshold = threshold.masked_fill((top_k >= logits.shape[1]).unsqueeze(1), _NEG_INF)
    return logits.masked_fill(logits < threshold, _NEG_INF)


def _nucleus_thresholds(ordered: Tensor, log_total: Tensor, top_k: Tensor,
                        top_p: Tensor) -> tuple[Tensor, Tensor]:
    """Smallest logit kept per row, from the best `ordered` [R, C] logits (descending).

    Also says per row whether C candidates were enough: the nucleus closed inside them.
    """
    positions = torch.arange(ordered.shape[1], device=ordered.device)
    ordered = ordered.masked_fill(positions >= top_k.unsqueeze(1), _NEG_INF)
    in_top_k = top_k.unsqueeze(1) <= ordered.shape[1]
    log_total = torch.where(in_top_k, ordered.logsumexp(dim=-1, keepdim=True), log_total)
    probs = (ordered - log_total).exp()
    mass = probs.cumsum(dim=-1)
    kept = ((mass - probs) < top_p).sum(dim=-1, keepdim=True)
    kept = torch.minimum(kept, top_k.unsqueeze(1).clamp_max(ordered.shape[1])).clamp_min(1)
    thresholds = ordered.gather(1, kept - 1)
    resolved = in_top_k | (mass[:, -1:] >= top_p) | torch.isinf(top_p)
    return thresholds.masked_fill(torch.isinf(top_p) & ~in_top_k, _NEG_INF), resolved


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_k_max: int, top_p: Tensor) -> Tensor:
    """Top-k, then the smallest set of best tokens whose renormalized mass reaches top_p.

    Searches the best _TOP_P_CANDIDATES (at least max k) logits first and sorts the
    whole vocabulary only when some row's nucleus is wider; ties at the threshold survive.
    """
    vocab_size = logits.shape[1]
    if top_k is None:
        top_k = torch.full((logits.shape[0],), vocab_size, dtype=torch.long, device=logits.device)
    log_total = logits.logsumexp(dim=-1, keepdim=True)
    candidates = min(vocab_size, max(_TOP_P_CANDIDATES, top_k_max))
    ordered = logits.topk(candidates, dim=-1).values
    thresholds, resolved = _nucleus_thresholds(ordered, log_total, top_k, top_p)
    if candidates < vocab_size and not bool(resolved.all()):
        ordered = logits.sort(dim=-1, descending=True).values
        thresholds, _ = _nucleus_thresholds(ordered, log_total, top_k, top_p)
    return logits.masked_fill(logits < thresholds, _NEG_INF)


def _noise_keys(meta: RandomMetadata, num_rows: int, device: torch.device,
                generator: torch.Generator | None) -> Tensor:
    """One noise key per random row: a seeded row's own, the others' from `generator`."""
    seeded = meta.seeded
    if seeded is None:
        return random_row_keys(num_rows, device, generator)
    if seeded.positions is None:
        return seeded.keys
    return random_row_keys(num_rows, device, generator).index_copy_(0, seeded.positions,
                                                                    seeded.keys)


def filter_random(logits: Tensor, meta: RandomMetadata) -> Tensor:
    """The random rows' logits [R, V] (already penalized) as they are sampled from: float32,
    divided by the temperature, with min_p, top-k and top-p applied (-inf where dropped)."""
    logits = logits.float() / meta.temperature
    if meta.min_p_log is not None:
        logits = apply_min_p(logits, meta.min_p_log)
    if meta.top_p is not None:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_k_max, meta.top_p)
    elif meta.top_k is not None:
        logits = apply_top_k(logits, meta.top_k, meta.top_k_max)
    return logits


def sample_random(logits: Tensor, meta: RandomMetadata, generator: torch.Generator | None) -> Tensor:
    """Token ids [R] for the random rows `logits` [R, V] (already penalized)."""
    logits = filter_random(logits, meta)
    keys = _noise_keys(meta, logits.shape[0], logits.device, generator)
    return argmax_rows(subtract_noise_(logits, keys))


def compute_logprobs(raw_logits: Tensor, token_ids: Tensor,
                     meta: LogprobMetadata) -> list[TokenLogprobs]:
    """Logprobs of the raw model output for the rows in `meta`, in meta.row_list order."""
    logprobs = raw_logits.index_select(0, meta.rows).float().log_softmax(dim=-1)
    chosen = token_ids.index_select(0, meta.rows).unsqueeze(1)
    chosen_logprob = logprobs.gather(1, chosen)
    ranks = (logprobs > chosen_logprob).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(meta.max_top, dim=-1)
    rows = zip(chosen.squeeze(1).tolist(), chosen_logprob.squeeze(1).tolist(), ranks.tolist(),
               top_ids.tolist(), top_values.tolist(), meta.num_top)
    return [
        TokenLogprobs(token_id=token, logprob=logprob, rank=rank,
                      top=list(zip(ids[:k], values[:k])))
        for token, logprob, rank, ids, values, k in rows
    ]


class Sampler:
    """Stateless; call once per step with the logits of every row that samples."""

    def __call__(self, logits: Tensor, metadata: SamplingMetadata,
                 generator: torch.Generator | None = None) -> SamplerOutput:
        expected = (metadata.num_rows, metadata.vocab_size)
        if tuple(logits.shape) != expected:
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match metadata {expected}.")
        processed = self.process_logits(logits, metadata)
        token_ids = self._select(processed, metadata, generator)
        logprobs: list[TokenLogprobs | None] = [None] * metadata.num_rows
        if metadata.logprobs is not None:
            row_logprobs = compute_logprobs(logits, token_ids, metadata.logprobs)
            for row, entry in zip(metadata.logprobs.row_list, row_logprobs):
                logprobs[row] = entry
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    @staticmethod
    def process_logits(logits: Tensor, metadata: SamplingMetadata) -> Tensor:
        """Min-tokens mask, logit bias and penalties in float32, then the grammar's token mask:
        what greedy rows take the argmax of. Logits that need none stay in the model's dtype:
        the argmax of a greedy step reads them as they are (a float32 copy of a [256, 49152]
        step cost 10 ms). The raw logits are never written: logprobs are read from them."""
        if metadata.token_mask is None:
            return Sampler._edit_logits(logits, metadata)
        # last: no bias or penalty revives a banned token
        edited = Sampler._edit_logits(logits, metadata)
        return apply_token_mask(edited, metadata.token_mask, in_place=edited is not logits)

    @staticmethod
    def _edit_logits(logits: Tensor, metadata: SamplingMetadata) -> Tensor:
        if (metadata.min_tokens_mask is None and metadata.logit_bias is None
                and metadata.penalties is None):
            return logits
        logits = logits.float()
        if metadata.min_tokens_mask is not None:
            logits = _apply_edit(logits, metadata.min_tokens_mask, accumulate=False)
        if metadata.logit_bias is not None:
            logits = _apply_edit(logits, metadata.logit_bias, accumulate=True)
        penalties = metadata.penalties
        if penalties is not None:
            logits = _on_rows(logits, penalties.rows, lambda rows: apply_penalties(rows, penalties))
        return logits

    @staticmethod
    def _select(logits: Tensor, metadata: SamplingMetadata,
                generator: torch.Generator | None) -> Tensor:
        random = metadata.random
        if random is None:
            return argmax_rows(logits)
        if random.rows is None:
            return sample_random(logits, random, generator)
        sampled = sample_random(logits.index_select(0, random.rows), random, generator)
        return argmax_rows(logits).index_copy(0, random.rows, sampled)
