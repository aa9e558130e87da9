"""A smaller model of the same vocabulary drafts k tokens, one forward per token.

The draft keeps its own paged KV cache, with a block pool of its own as large as the
target's in blocks (a draft's blocks are much smaller), so that the target's scheduler,
prefix cache and preemption never need to know about it. Per request it remembers how many
of the request's tokens its cache holds; a step that accepts fewer drafts than were fed
simply leaves that count at the last token both agree on, and the next proposal catches
up from there (the whole prompt, the first time). A request the draft pool has no room for
drafts nothing that step.

Drafts are sampled as vLLM's `draft_sample_method` says: `greedy` (the draft's argmax; the
verifier then treats the draft as one-hot) or `probabilistic` (sampled at the request's
temperature, their probabilities kept for the rejection sampler). Greedy requests always
draft greedily.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from pagellm.core.block_pool import BlockPool
from pagellm.core.kv_cache_manager import cdiv
from pagellm.logger import init_logger
from pagellm.model.attention import build_attention_metadata, kv_cache_shape
from pagellm.model.loader import LoadedModel
from pagellm.request import Request
from pagellm.spec_decode.draft import Draft
from pagellm.spec_decode.rejection_sampler import seeded_generator

logger = init_logger(__name__)
_DRAFT = 1  # told apart from the verifier's seeded draws


@dataclass
class _DraftState:
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0


@dataclass
class _Feed:
    """One request's tokens in one draft forward, from position `start`."""

    request: Request
    tokens: list[int]
    start: int


class DraftModelProposer:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int,
                 device: torch.device, kv_cache_dtype: torch.dtype, probabilistic: bool,
                 batch_invariant: bool, generator: torch.Generator) -> None:
        self.model = loaded.model
        self.arch = loaded.arch
        self.block_size = block_size
        self.device = device
        self.probabilistic = probabilistic
        self.batch_invariant = batch_invariant
        self.generator = generator
        self.pool = BlockPool(num_blocks)
        arch = loaded.arch
        shape = kv_cache_shape(num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=kv_cache_dtype, device=device)
                          for _ in range(arch.num_hidden_layers)]
        self.states: dict[str, _DraftState] = {}

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, Draft]:
        """Drafts of up to k tokens for each (request, k) that has room, by request id."""
        limits = {request.request_id: k for request, k in wanted}
        feeds = [self._catch_up(request, k) for request, k in wanted]
        feeds = [feed for feed in feeds if feed is not None]
        drafts: dict[str, Draft] = {}
        probs: dict[str, list[Tensor]] = {}
        while feeds:
            positions = [f.request.num_output_tokens + len(drafts.get(f.request.request_id, ()))
                         for f in feeds]
            tokens, chosen_probs = self._sample(feeds, self._forward(feeds), positions)
            next_feeds = []
            for feed, token, row_probs in zip(feeds, tokens, chosen_probs):
                request_id = feed.request.request_id
                draft = drafts.setdefault(request_id, Draft([]))
                draft.token_ids.append(token)
                if row_probs is not None:
                    probs.setdefault(request_id, []).append(row_probs)
                end = feed.start + len(feed.tokens)
                self.states[request_id].num_computed = end
                if len(draft) < limits[request_id]:
                    next_feeds.append(_Feed(feed.request, [token], end))
            feeds = next_feeds
        for request_id, rows in probs.items():
            drafts[request_id].probs = torch.stack(rows)
        return drafts

    def _catch_up(self, request: Request, k: int) -> _Feed | None:
        """The request's tokens the draft's cache lacks, with blocks for them and k - 1 drafts."""
        state = self.states.setdefault(request.request_id, _DraftState())
        state.num_computed = min(state.num_computed, request.num_tokens - 1)
        needed = cdiv(request.num_tokens + k - 1, self.block_size) - len(state.block_ids)
        if needed > self.pool.num_free_blocks:
            return None
        if needed > 0:
            state.block_ids.extend(self.pool.get_new_blocks(needed))
        return _Feed(request, request.all_token_ids[state.num_computed:], state.num_computed)

    def _forward(self, feeds: list[_Feed]) -> Tensor:
        """Logits [len(feeds), vocab] after each feed's last token."""
        size = self.block_size
        positions, slots, query_lens, seq_lens, last_rows = [], [], [], [], []
        for feed in feeds:
            pos = np.arange(feed.start, feed.start + len(feed.tokens), dtype=np.int64)
            blocks = np.asarray(self.states[feed.request.request_id].block_ids, dtype=np.int64)
            positions.append(pos)
            slots.append(blocks[pos // size] * size + pos % size)
            query_lens.append(len(feed.tokens))
            seq_lens.append(feed.start + len(feed.tokens))
            last_rows.append(sum(query_lens) - 1)
        device = self.device
        slot_mapping = torch.from_numpy(np.concatenate(slots)).to(device)
        tables = [self.states[feed.request.request_id].block_ids for feed in feeds]
        metadata = build_attention_metadata(query_lens, seq_lens, tables, slot_mapping, size,
                                            device, self.batch_invariant)
        input_ids = torch.tensor([t for feed in feeds for t in feed.tokens], dtype=torch.long,
                                 device=device)
        hidden = self.model(input_ids, torch.from_numpy(np.concatenate(positions)).to(device),
                            self.kv_caches, metadata,
                            torch.tensor(last_rows, dtype=torch.long, device=device))
        return self.model.compute_logits(hidden).float()

    def _sample(self, feeds: list[_Feed], logits: Tensor,
                positions: list[int]) -> tuple[list[int], list[Tensor | None]]:
        """`positions`: each feed's next output position. Greedy rows (and every row under `greedy`) take the argmax; the others sample at
        their temperature and keep the distribution they sampled from."""
        tokens = logits.argmax(dim=-1).tolist()
        chosen: list[Tensor | None] = [None] * len(feeds)
        if not self.probabilistic:
            return tokens, chosen
        for row, (feed, position) in enumerate(zip(feeds, positions)):
            request = feed.request
            params = request.sampling_params
            if params.greedy:
                continue
            generator = self.generator
            if params.seed is not None:  # a seeded request's drafts reproduce too
                generator = seeded_generator(params.seed, (request.index, position, _DRAFT),
                                             self.device)
            probs = (logits[row] / params.temperature).softmax(dim=-1)
            tokens[row] = int(torch.multinomial(probs, 1, generator=generator))
            chosen[row] = probs
        return tokens, chosen

    def forget(self, live_request_ids: set[str]) -> None:
        """Give back the blocks of requests that are gone."""
        for request_id in [r for r in self.states if r not in live_request_ids]:
            self.pool.free_blocks(self.states.pop(request_id).block_ids)
