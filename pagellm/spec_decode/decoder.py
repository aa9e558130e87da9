"""Speculative decoding in the engine core: before each step, drafts for the decoding
requests; after it, what was accepted.

The path of a draft: `propose` sets `request.draft` (the controller says how many tokens
each request may draft; the n-gram lookup or the draft model fills them; a grammar cuts the
draft where it stops accepting) -> the scheduler schedules its tokens after the request's
last token, as far as the step's budget and the request's max_tokens allow -> the model
runner verifies them in the step's one forward (`pagellm.spec_decode.verify`) -> the
scheduler appends the emitted tokens and drops the KV of the rejected ones -> `observe`
counts drafts and acceptances for the metrics and the controller.
"""

from __future__ import annotations

import time

import torch

from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.logger import init_logger
from pagellm.model.loader import LoadedModel, load_model
from pagellm.request import Request
from pagellm.spec_decode.config import SpeculativeConfig
from pagellm.spec_decode.controller import SpeculationController
from pagellm.spec_decode.draft import Draft
from pagellm.spec_decode.draft_model import DraftModelProposer
from pagellm.spec_decode.metrics import SpecDecodingStats
from pagellm.spec_decode.ngram import NgramProposer

logger = init_logger(__name__)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 draft_model: DraftModelProposer | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.controller = SpeculationController(config.num_speculative_tokens,
                                                adaptive=not config.disable_adaptive)
        self.ngram = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                      if config.method == "ngram" else None)
        self.draft_model = draft_model
        self.stats = SpecDecodingStats(config.num_speculative_tokens)

    def propose(self, running: list[Request], live_request_ids: set[str]) -> None:
        """Drafts for this step's decodes (requests whose only uncomputed token is their last)."""
        start = time.perf_counter()
        self.controller.forget(live_request_ids)
        if self.draft_model is not None:
            self.draft_model.forget(live_request_ids)
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        wanted = []
        for request in running:
            request.draft = None
        for request in decoding:
            room = min(request.max_tokens - request.num_output_tokens,
                       self.max_model_len - request.num_tokens) - 1
            k = min(self.controller.num_tokens(request.request_id, len(decoding)), room)
            if k > 0:
                wanted.append((request, k))
        drafts = self._drafts(wanted)
        num_tokens = 0
        for request, _ in wanted:
            draft = drafts.get(request.request_id)
            if draft is not None and request.grammar is not None:
                constrain_to_grammar(request, draft)
            if draft:
                request.draft = draft
                num_tokens += len(draft)
        self.controller.observe_proposal(num_tokens, time.perf_counter() - start)

    def _drafts(self, wanted: list[tuple[Request, int]]) -> dict[str, Draft]:
        if self.ngram is None:
            return self.draft_model.propose(wanted) if wanted else {}
        drafts = {}
        for request, k in wanted:
            tokens = self.ngram.propose(request.all_token_ids, k)
            if tokens:
                drafts[request.request_id] = Draft(tokens)
        return drafts

    def observe(self, scheduled: SchedulerOutput, output: ModelRunnerOutput,
                seconds: float) -> None:
        """After the step: its cost for the controller, and each verified draft's fate."""
        self.controller.observe_step(scheduled.num_scheduled_tokens, seconds)
        for item in scheduled.scheduled:
            if item.num_draft_tokens:
                request_id = item.request.request_id
                accepted = len(output.sampled[request_id]) - 1
                self.stats.observe(item.num_draft_tokens, accepted)
                self.controller.observe_draft(request_id, item.num_draft_tokens, accepted)


def constrain_to_grammar(request: Request, draft: Draft) -> None:
    """Cut the draft before its first token the grammar rejects, and keep the grammar's state
    before each draft token for the masks of the verifying rows. The request's own matcher
    never moves: forks walk the draft."""
    grammar = request.grammar
    if not grammar.active:
        return
    states = [grammar]
    walker = grammar.fork()
    for index, token in enumerate(draft.token_ids):
        if not walker.active or not walker.matcher.accept(token):
            draft.truncate(index)
            break
        states.append(walker)
        walker = walker.fork()
    draft.grammars = states[:len(draft) + 1]


def load_draft_model(config: SpeculativeConfig, target: LoadedModel, num_blocks: int,
                     block_size: int, device: torch.device, dtype: torch.dtype,
                     kv_cache_dtype: torch.dtype, batch_invariant: bool,
                     seed: int) -> DraftModelProposer:
    """The draft model of `config`, which must share the target's vocabulary."""
    start = time.perf_counter()
    loaded = load_model(config.model, dtype, device, None, 0, False, batch_invariant)
    if (loaded.arch.vocab_size != target.arch.vocab_size
            or loaded.tokenizer.get_vocab() != target.tokenizer.get_vocab()):
        raise ValueError(f"the draft model {config.model} does not share the target model's "
                         "tokenizer and vocabulary.")
    generator = torch.Generator(device=device)
    generator.manual_seed(seed + 1)
    logger.info("Draft model %s loaded for speculative decoding in %.2f seconds",
                config.model, time.perf_counter() - start)
    return DraftModelProposer(loaded, num_blocks, block_size, device, kv_cache_dtype,
                              config.draft_sample_method == "probabilistic", batch_invariant,
                              generator)
