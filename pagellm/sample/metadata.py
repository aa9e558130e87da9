"""Per-step sampling metadata: the batch's SamplingParams turned into tensors.

Every stage is optional; a field is None when no row in the batch needs that
stage, so the sampler can skip it entirely. Row index tensors are None when a
stage applies to every row (no gather/scatter needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pagellm.sample.noise import seeded_row_keys
from pagellm.sampling_params import SamplingParams
from pagellm.structured_outputs.manager import fill_bitmasks

_U64 = 1 << 64
_I64_LIMIT = 1 << 63


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None
    seed_stream: int = 0  # index among the n siblings of one prompt
    # structured outputs: fills this row's allowed-token bitmask (fill_bitmask(mask, row))
    grammar: Any = None


@dataclass
class SparseLogitEdit:
    """Values written into (row, token) cells of the logits."""
    rows: Tensor
    tokens: Tensor
    values: Tensor


@dataclass
class PenaltyMetadata:
    rows: Tensor | None
    presence: Tensor  # [P, 1]
    frequency: Tensor  # [P, 1]
    output_tokens: Tensor  # [P, L] padded with vocab_size
    repetition: Tensor | None  # [P, 1]; None when no row uses it
    prompt_tokens: Tensor | None  # [P, L] padded with vocab_size; with repetition only


@dataclass
class SeedMetadata:
    positions: Tensor | None  # positions inside the random subset; None = all of it
    keys: Tensor  # [S] int64 per-row 32-bit noise keys


@dataclass
class RandomMetadata:
    rows: Tensor | None  # batch rows that sample randomly; None = all rows
    temperature: Tensor  # [R, 1]
    min_p_log: Tensor | None  # [R, 1] log(min_p); -inf disables
    top_k: Tensor | None  # [R] long; vocab_size disables
    top_k_max: int  # largest enabled k; 0 when none
    top_p: Tensor | None  # [R, 1]; inf disables
    seeded: SeedMetadata | None


@dataclass
class TokenMaskMetadata:
    """Allowed tokens of the grammar-constrained rows: bit j of word i allows 32 * i + j."""
    rows: Tensor | None  # None = every row
    bitmask: Tensor  # [G, ceil(vocab / 32)] int32


@dataclass
class LogprobMetadata:
    rows: Tensor
    row_list: list[int]
    num_top: list[int]
    max_top: int


@dataclass
class SamplingMetadata:
    num_rows: int
    vocab_size: int
    logit_bias: SparseLogitEdit | None
    min_tokens_mask: SparseLogitEdit | None
    penalties: PenaltyMetadata | None
    random: RandomMetadata | None
    logprobs: LogprobMetadata | None
    token_mask: TokenMaskMetadata | None = None


def _index(rows: list[int], total: int, device: torch.device) -> Tensor | None:
    if len(rows) == total:
        return None
    return torch.tensor(rows, dtype=torch.long, device=device)


def _column(values: list[float], device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _padded(token_lists: list[list[int]], pad: int, device: torch.device) -> Tensor:
    width = max((len(t) for t in token_lists), default=0)
    rows = [t + [pad] * (width - len(t)) for t in token_lists]
    return torch.tensor(rows, dtype=torch.long, device=device).view(len(rows), width)


def _check_token(token: int, vocab_size: int, what: str) -> None:
    if not 0 <= token < vocab_size:
        raise ValueError(f"{what} token id {token} is outside the vocabulary [0, {vocab_size}).")


def _sparse_edit(cells: list[tuple[int, int, float]], device: torch.device) -> SparseLogitEdit | None:
    if not cells:
        return None
    rows, tokens, values = zip(*cells)
    return SparseLogitEdit(
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        values=torch.tensor(values, dtype=torch.float32, device=device),
    )


def _logit_bias(rows: Sequence[SamplingRow], vocab_size: int,
                device: torch.device) -> SparseLogitEdit | None:
    cells = []
    for i, row in enumerate(rows):
        for token, bias in (row.params.logit_bias or {}).items():
            _check_token(token, vocab_size, "logit_bias")
            cells.append((i, token, bias))
    return _sparse_edit(cells, device)


def _min_tokens_mask(rows: Sequence[SamplingRow], vocab_size: int,
                     device: torch.device) -> SparseLogitEdit | None:
    """EOS and stop_token_ids are banned until min_tokens outputs exist (EOS even with ignore_eos)."""
    cells = []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) >= row.params.min_tokens:
            continue
        banned = set(row.params.stop_token_ids or [])
        if row.eos_token_id is not None:
            banned.add(row.eos_token_id)
        cells.extend((i, t, float("-inf")) for t in sorted(banned) if 0 <= t < vocab_size)
    return _sparse_edit(cells, device)


def _uses_penalties(params: SamplingParams) -> bool:
    return (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0)


def _penalties(rows: Sequence[SamplingRow], vocab_size: int,
               device: torch.device) -> PenaltyMetadata | None:
    picked = [i for i, row in enumerate(rows) if _uses_penalties(row.params)]
    if not picked:
        return None
    params = [rows[i].params for i in picked]
    any_repetition = any(p.repetition_penalty != 1.0 for p in params)
    return PenaltyMetadata(
        rows=_index(picked, len(rows), device),
        presence=_column([p.presence_penalty for p in params], device),
        frequency=_column([p.frequency_penalty for p in params], device),
        output_tokens=_padded([rows[i].output_token_ids for i in picked], vocab_size, device),
        repetition=_column([p.repetition_penalty for p in params], device) if any_repetition else None,
        prompt_tokens=(_padded([rows[i].prompt_token_ids for i in picked], vocab_size, device)
                       if any_repetition else None),
    )


def _seed_as_int64(seed: int) -> int:
    seed %= _U64
    return seed - _U64 if seed >= _I64_LIMIT else seed


def _seeds(rows: list[SamplingRow], device: torch.device) -> SeedMetadata | None:
    seeded = [j for j, row in enumerate(rows) if row.params.seed is not None]
    if not seeded:
        return None

    def column(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    keys = seeded_row_keys(
        column([_seed_as_int64(rows[j].params.seed) for j in seeded]),
        column([rows[j].seed_stream for j in seeded]),
        column([len(rows[j].output_token_ids) for j in seeded]),
    )
    return SeedMetadata(positions=_index(seeded, len(rows), device), keys=keys)


def _random(rows: Sequence[SamplingRow], vocab_size: int,
            device: torch.device) -> RandomMetadata | None:
    picked = [i for i, row in enumerate(rows) if not row.params.greedy]
    if not picked:
        return None
    params = [rows[i].params for i in picked]
    seeded = _seeds([rows[i] for i in picked], device)
    enabled_k = [p.top_k for p in params if 0 < p.top_k < vocab_size]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    return RandomMetadata(
        rows=_index(picked, len(rows), device),
        temperature=_column([p.temperature for p in params], device),
        min_p_log=(torch.log(_column([p.min_p for p in params], device))
                   if any(p.min_p > 0.0 for p in params) else None),
        top_k=torch.tensor(top_k, dtype=torch.long, device=device) if enabled_k else None,
        top_k_max=max(enabled_k, default=0),
        top_p=(_column([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device)
               if any(p.top_p < 1.0 for p in params) else None),
        seeded=seeded,
    )


def _logprobs(rows: Sequence[SamplingRow], device: torch.device) -> LogprobMetadata | None:
    picked = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not picked:
        return None
    num_top = [rows[i].params.logprobs for i in picked]
    return LogprobMetadata(
        rows=torch.tensor(picked, dtype=torch.long, device=device),
        row_list=picked,
        num_top=num_top,
        max_top=max(num_top),
    )


def build_token_mask(rows: Sequence[SamplingRow], vocab_size: int,
                     device: torch.device) -> TokenMaskMetadata | None:
    """Each constrained row's grammar fills its bitmask row; a finished grammar leaves none."""
    picked = [i for i, row in enumerate(rows) if row.grammar is not None and row.grammar.active]
    if not picked:
        return None
    bitmask = torch.full((len(picked), -(-vocab_size // 32)), -1, dtype=torch.int32)
    fill_bitmasks([rows[i].grammar for i in picked], bitmask)
    return TokenMaskMetadata(rows=_index(picked, len(rows), device),
                             bitmask=bitmask.to(device, non_blocking=True))


def build_sampling_metadata(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device,
                            token_mask: Future[TokenMaskMetadata | None] | None = None
                            ) -> SamplingMetadata:
    """Tensors for one sampler call; row i of the logits belongs to rows[i]. `token_mask`: the
    rows' `build_token_mask`, already under way (the model runner fills it during the
    forward); built here when None."""
    return SamplingMetadata(
        num_rows=len(rows),
        vocab_size=vocab_size,
        logit_bias=_logit_bias(rows, vocab_size, device),
        min_tokens_mask=_min_tokens_mask(rows, vocab_size, device),
        penalties=_penalties(rows, vocab_size, device),
        random=_random(rows, vocab_size, device),
        logprobs=_logprobs(rows, device),
        token_mask=(build_token_mask(rows, vocab_size, device) if token_mask is None
                    else token_mask.result()),
    )
