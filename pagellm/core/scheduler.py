"""Continuous batching: which tokens of which requests run in the next step.

There are no prefill and decode phases. Each request has tokens (prompt and
output so far) and a count of tokens whose KV is computed; every step lets
the computed count catch up under one token budget. Running requests go
first, in admission order, then waiting ones in FCFS order. Long prompts are
thereby split over steps (chunked prefill), and a prefill chunk leaves room
for the running decodes behind it.

A preempted request is either recomputed later (its blocks are freed and its
computed count drops to zero) or, when a second KV tier has room, swapped:
its blocks are copied there and come back when it is admitted again, with its
computed count intact. `preemption_mode` forces one way; `auto` picks the
cheaper one by `SwapCostModel` (recompute when there is none).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import replace

from pagellm.config import SchedulerConfig
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.offload import SwapCostModel
from pagellm.core.sched_output import (KVTransferStats, ModelRunnerOutput, OffloadStats,
                                       RequestUpdate, ScheduledRequest, SchedulerOutput,
                                       SchedulerStats)
from pagellm.request import Request, RequestStatus, child_request_id
from pagellm.logprobs import TokenLogprobs


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 swap_cost: SwapCostModel | None = None, max_concurrent_batches: int = 1) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.swap_cost = swap_cost
        self.max_concurrent_batches = max_concurrent_batches
        # ids of the requests in batches scheduled but not yet updated (pipeline parallelism)
        self.in_flight: set[str] = set()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_swaps = 0
        self.num_recomputes = 0
        self.transfers = KVTransferStats()
        self._step_prompt_tokens = 0
        self._step_generation_tokens = 0

    def add_request(self, request: Request) -> None:
        self.kv.hash_new_blocks(request)
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        self._step_generation_tokens = 0
        limit = self._batch_limit()
        budget = self._schedule_running(output, self.config.max_num_batched_tokens, limit)
        if not output.preempted:
            self._schedule_waiting(output, budget, limit)
        if (output.is_empty and self.waiting and not self.in_flight
                and self._release_waiting_blocks()):
            self._schedule_waiting(output, budget, limit)
        output.kv_stores, output.kv_loads = self.kv.take_transfers()
        self._step_prompt_tokens = sum(
            min(s.num_tokens, max(0, s.request.num_prompt_tokens - s.start)) for s in output.scheduled)
        if self.max_concurrent_batches > 1:
            self.in_flight.update(s.request.request_id for s in output.scheduled)
        return output

    def _batch_limit(self) -> int:
        """The requests one batch may take. With several batches in flight (pipeline
        parallelism) a request runs in one at a time, so a batch takes an even share of
        those that could run: one batch holding them all would leave the next nothing to
        schedule until it returns, and the stages would take turns again."""
        if self.max_concurrent_batches == 1:
            return self.config.max_num_seqs
        could_run = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
        return max(1, -(-could_run // self.max_concurrent_batches))

    def _schedule_running(self, output: SchedulerOutput, budget: int, limit: int) -> int:
        """Running requests in admission order; one in a batch still in flight has nothing
        to run before its result comes back (a decode waits for its token; a prefill's next
        chunk waits too, as its computed count advances with the result)."""
        in_flight = self.in_flight
        pending_decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1
                              and r.request_id not in in_flight)
        index = 0
        while index < len(self.running) and budget > 0 and len(output.scheduled) < limit:
            request = self.running[index]
            index += 1
            if request.request_id in in_flight:
                continue
            remaining = request.num_tokens - request.num_computed_tokens
            num_drafts = 0
            if remaining == 1:
                pending_decodes -= 1
                num_drafts = self._num_drafts(request, budget - 1 - pending_decodes)
                num_tokens = 1 + num_drafts
            else:
                num_tokens = min(remaining, max(1, budget - pending_decodes))
            num_tokens = min(num_tokens, budget)
            if not self._make_room(request, num_tokens, output):
                break
            self.kv.allocate_slots(request, num_tokens)
            output.scheduled.append(ScheduledRequest.for_chunk(request, num_tokens, num_drafts))
            budget -= num_tokens
        return budget

    def _num_drafts(self, request: Request, spare_budget: int) -> int:
        """Draft tokens to verify beside a decode: what the budget spares once every decode
        behind it has its token, and never more than max_tokens or max_model_len leave room
        for (a step emits up to one token more than it verifies)."""
        if request.draft is None:
            return 0
        room = min(request.max_tokens - request.num_output_tokens,
                   self.config.max_model_len - request.num_tokens) - 1
        return max(0, min(len(request.draft), spare_budget, room))

    def _make_room(self, request: Request, num_tokens: int, output: SchedulerOutput) -> bool:
        """Preempt the most recently admitted requests until `request` fits; False if it went too."""
        while not self.kv.can_allocate(request, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            output.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        if self._should_swap(request):
            self.kv.swap_out(request)
            self.num_swaps += 1
        else:
            self.kv.free(request)
            request.num_computed_tokens = 0
            self.num_recomputes += 1
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _should_swap(self, request: Request) -> bool:
        mode = self.config.preemption_mode
        if mode == "recompute" or not self.kv.can_swap_out(request):
            return False
        if mode == "swap":
            return True
        return self.swap_cost is not None and self.swap_cost.prefers_swap(
            request.num_computed_tokens, len(request.block_ids))

    def _next_waiting(self) -> Request | None:
        """The first waiting request that can run: one whose grammar still compiles is passed
        over, so it holds up no one behind it, and so is one whose LoRA adapter would make
        the running requests' distinct adapters more than max_loras, and so is one preempted
        while its batch is in flight (until that batch's result, dropped, comes back)."""
        ready = (r for r in self.waiting if r.schedulable and r.request_id not in self.in_flight)
        if not self.config.max_loras:
            return next(ready, None)
        active = {r.lora_key for r in self.running} - {0}
        room = len(active) < self.config.max_loras
        return next((r for r in ready if room or r.lora_key in active or not r.lora_key), None)

    def _schedule_waiting(self, output: SchedulerOutput, budget: int, limit: int) -> None:
        while (budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(output.scheduled) < limit):
            request = self._next_waiting()
            if request is None:
                break
            computed = self.kv.get_computed_blocks(request)
            offloaded = self.kv.get_offloaded_blocks(request, len(computed))
            num_computed = self.kv.resume_position(request, len(computed) + len(offloaded))
            num_tokens = min(request.num_tokens - num_computed, budget)
            if not self.kv.can_allocate(request, num_tokens, computed, offloaded):
                break
            if self.waiting[0] is request:
                self.waiting.popleft()
            else:
                self.waiting.remove(request)
            if request.num_computed_tokens == 0:
                self.kv.record_prefix_lookup(request, computed)
            self.kv.allocate_slots(request, num_tokens, computed, offloaded)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.scheduled.append(ScheduledRequest.for_chunk(request, num_tokens))
            budget -= num_tokens

    def _release_waiting_blocks(self) -> bool:
        """Last resort when nothing can run: waiting forks give back the blocks they share."""
        holders = [r for r in self.waiting if r.block_ids]
        for request in holders:
            self.kv.free(request)
            request.num_computed_tokens = 0
        return bool(holders)

    def update_from_output(self, scheduled: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[RequestUpdate]:
        """Advance computed counts, append sampled tokens, finish requests that are done. A
        request finished, aborted or preempted while its batch was in flight (its blocks
        freed then) is no longer running: its late result is dropped."""
        updates: list[RequestUpdate] = []
        self.transfers.add(runner_output.transfers)
        for item in scheduled.scheduled:
            request = item.request
            self.in_flight.discard(request.request_id)
            if request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += item.num_tokens
            if item.num_scored:
                request.prompt_logprobs.extend(runner_output.prompt_logprobs[request.request_id])
            sampled = runner_output.sampled.get(request.request_id)
            if not sampled:
                continue
            logprobs = runner_output.logprobs.get(request.request_id) or [None] * len(sampled)
            if item.num_draft_tokens:
                updates.append(self._accept_verified(request, item, sampled, logprobs))
                continue
            for child_index, (token_id, logprob) in enumerate(zip(sampled[1:], logprobs[1:]), 1):
                updates.append(self._fork_child(request, child_index, token_id, logprob))
            updates.append(self._append_token(request, sampled[0], logprobs[0]))
        return updates

    def _accept_verified(self, request: Request, item: ScheduledRequest, tokens: list[int],
                         logprobs: list[TokenLogprobs | None]) -> RequestUpdate:
        """A verified draft: the KV of its rejected tokens is dropped (their slots are written
        again by the next step; blocks left empty go back), then its tokens are appended."""
        request.num_computed_tokens -= item.num_draft_tokens + 1 - len(tokens)
        self.kv.free_unused_tail(request)
        return self._append_tokens(request, tokens, logprobs)

    def _append_token(self, request: Request, token_id: int,
                      logprob: TokenLogprobs | None) -> RequestUpdate:
        return self._append_tokens(request, [token_id], [logprob])

    def _append_tokens(self, request: Request, token_ids: list[int],
                       logprobs: list[TokenLogprobs | None]) -> RequestUpdate:
        """Append in order until one finishes the request; the tokens after it are dropped.
        The first token's update carries the prompt logprobs, complete by then."""
        prompt_logprobs = None
        if (request.num_output_tokens == 0 and request.parent_id is None
                and request.sampling_params.prompt_logprobs is not None):
            prompt_logprobs = list(request.prompt_logprobs)
        appended = 0
        for token_id in token_ids:
            request.append_output_token(token_id)
            if request.grammar is not None:
                request.grammar.accept(token_id)
            appended += 1
            self.kv.hash_new_blocks(request)
            status = self._check_stop(request, token_id)
            if status is not None:
                self._finish(request, status)
                break
        self._step_generation_tokens += appended
        return RequestUpdate(request.request_id, request.parent_id, request.index,
                             token_ids[:appended], logprobs[:appended],
                             request.status.finish_reason, request.stop_reason, prompt_logprobs)

    def _fork_child(self, parent: Request, index: int, token_id: int,
                    logprob: TokenLogprobs | None) -> RequestUpdate:
        child = Request(
            request_id=child_request_id(parent.request_id, index), prompt_token_ids=parent.prompt_token_ids,
            sampling_params=parent.sampling_params, max_tokens=parent.max_tokens,
            eos_token_id=parent.eos_token_id, arrival_time=parent.arrival_time,
            parent_id=parent.request_id, index=index,
            grammar=parent.grammar.fork() if parent.grammar is not None else None,
            lora_request=parent.lora_request, lora=parent.lora)
        self.kv.fork(parent, child)
        self.requests[child.request_id] = child
        self.waiting.appendleft(child)
        return self._append_token(child, token_id, logprob)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if (request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.config.max_model_len):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside the step (abort, stop string); unknown ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self.requests.pop(request.request_id, None)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage(), num_prompt_tokens=self._step_prompt_tokens,
            num_generation_tokens=self._step_generation_tokens,
            num_preemptions=self.num_preemptions, prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits, num_preemptions_swap=self.num_swaps,
            num_preemptions_recompute=self.num_recomputes, offload=self._offload_stats())

    def _offload_stats(self) -> OffloadStats | None:
        offload = self.kv.offload
        if offload is None:
            return None
        return OffloadStats(usage=offload.usage(), allocation_bytes=offload.num_bytes,
                            transfers=replace(self.transfers))

    def check_integrity(self) -> None:
        self.kv.check_integrity(list(self.requests.values()))
