"""Turns per-step token updates into user-facing outputs: text, stop strings, n siblings."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from pagellm.core.sched_output import RequestUpdate
from pagellm.detokenizer import IncrementalDetokenizer
from pagellm.metrics.stats import FinishedRequestStats, IterationStats
from pagellm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from pagellm.logprobs import TokenLogprobs
from pagellm.sampling_params import OutputKind, SamplingParams


@dataclass
class _Sequence:
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    last_token_time: float | None = None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: OutputKind
    sequences: list[_Sequence]
    metrics: RequestMetrics
    prompt_logprobs: PromptLogprobs | None = None  # once the first token came
    prompt_logprobs_sent: bool = False  # delta outputs carry them once, in the first

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, kind: OutputKind, arrival_time: float) -> None:
        sequences = [_Sequence(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                               logprobs=[] if params.logprobs is not None else None,
                               cumulative_logprob=0.0 if params.logprobs is not None else None)
                     for _ in range(params.n)]
        self.states[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, kind,
                                               sequences, RequestMetrics(arrival_time))

    def has_request(self, request_id: str) -> bool:
        return request_id in self.states

    def abort(self, request_id: str) -> RequestOutput | None:
        """Mark every unfinished sequence aborted; returns the final output, if it was live."""
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        for sequence in state.sequences:
            sequence.finish_reason = sequence.finish_reason or "abort"
        return self._make_output(state, state.sequences)

    def process(self, updates: list[RequestUpdate], stats: IterationStats | None = None,
                failed: dict[str, Exception] | None = None
                ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs to hand out and the ids of requests a stop string finished.

        Latencies of this step are added to `stats` when given. With `failed`, a request
        whose output cannot be made (a detokenizer error) is left out and its error put
        there, so it fails alone; the caller aborts it. Without, the error propagates.
        """
        now = time.monotonic()
        stats = stats if stats is not None else IterationStats()
        touched: dict[str, list[_Sequence]] = {}
        stopped: list[str] = []
        for update in updates:
            state = self.states.get(update.parent_id or update.request_id)
            if state is None or (failed is not None and state.request_id in failed):
                continue
            with self._failing_alone(state.request_id, failed):
                sequence = state.sequences[update.index]
                if update.prompt_logprobs is not None:
                    state.prompt_logprobs = [None] + [self._to_logprob_dict(entry)
                                                      for entry in update.prompt_logprobs]
                if self._apply(sequence, update):
                    stopped.append(update.request_id)
                stats.num_generation_tokens += len(update.new_token_ids)
                self._record_latency(state, sequence, now, stats)
                touched.setdefault(state.request_id, [])
                if sequence not in touched[state.request_id]:
                    touched[state.request_id].append(sequence)
        outputs = []
        for request_id, sequences in touched.items():
            if failed is not None and request_id in failed:
                continue
            with self._failing_alone(request_id, failed):
                state = self.states[request_id]
                output = self._output_for(state, sequences, now)
                if state.finished:
                    stats.finished_requests.append(self._finished_stats(state, now))
                if output is not None:
                    outputs.append(output)
        return outputs, stopped

    @staticmethod
    @contextlib.contextmanager
    def _failing_alone(request_id: str, failed: dict[str, Exception] | None) -> Iterator[None]:
        try:
            yield
        except Exception as error:
            if failed is None:
                raise
            failed[request_id] = error

    @staticmethod
    def _record_latency(state: RequestState, sequence: _Sequence, now: float,
                        stats: IterationStats) -> None:
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
            stats.time_to_first_tokens.append(now - state.metrics.arrival_time)
        elif sequence.last_token_time is not None:
            stats.inter_token_latencies.append(now - sequence.last_token_time)
        sequence.last_token_time = state.metrics.last_token_time = now

    @staticmethod
    def _finished_stats(state: RequestState, now: float) -> FinishedRequestStats:
        reasons = [s.finish_reason for s in state.sequences]
        return FinishedRequestStats(
            finish_reason=reasons[0] or "abort", e2e_latency=now - state.metrics.arrival_time,
            num_prompt_tokens=len(state.prompt_token_ids),
            num_generation_tokens=sum(len(s.token_ids) for s in state.sequences))

    def _apply(self, sequence: _Sequence, update: RequestUpdate) -> bool:
        """Tokens one at a time (a step with speculative decoding brings several), so that
        the tokens after the one completing a stop string are dropped, as without it."""
        stop_token_ended = update.finish_reason == "stop"  # the core stops on tokens only
        last = len(update.new_token_ids) - 1
        for index, (token_id, logprob) in enumerate(zip(update.new_token_ids,
                                                        update.new_logprobs)):
            sequence.token_ids.append(token_id)
            if logprob is not None and sequence.logprobs is not None:
                sequence.logprobs.append(self._to_logprob_dict(logprob))
                sequence.cumulative_logprob += logprob.logprob
            stop_string = sequence.detokenizer.update([token_id],
                                                      stop_token_ended and index == last)
            if stop_string is not None:
                sequence.finish_reason, sequence.stop_reason = "stop", stop_string
                return not update.finished
        if update.finished:
            sequence.finish_reason, sequence.stop_reason = update.finish_reason, update.stop_reason
        return False

    def _to_logprob_dict(self, logprob: TokenLogprobs) -> dict[int, Logprob]:
        entries = {logprob.token_id: Logprob(logprob.logprob, logprob.rank)}
        for rank, (token_id, value) in enumerate(logprob.top, 1):
            entries.setdefault(token_id, Logprob(value, rank))
        for token_id, entry in entries.items():
            entry.decoded_token = self.tokenizer.decode([token_id])
        return entries

    def _output_for(self, state: RequestState, sequences: list[_Sequence],
                    now: float) -> RequestOutput | None:
        finished = state.finished
        if finished:
            state.metrics.finished_time = now
            del self.states[state.request_id]
        if state.kind is OutputKind.FINAL_ONLY:
            return self._make_output(state, state.sequences) if finished else None
        if state.kind is OutputKind.CUMULATIVE:
            return self._make_output(state, state.sequences)
        return self._make_output(state, sequences, delta=True)

    def _make_output(self, state: RequestState, sequences: list[_Sequence],
                     delta: bool = False) -> RequestOutput:
        completions = [self._completion(state, seq, delta) for seq in sequences]
        prompt_logprobs = state.prompt_logprobs
        if delta and state.prompt_logprobs_sent:
            prompt_logprobs = None
        state.prompt_logprobs_sent |= prompt_logprobs is not None
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             finished=state.finished, metrics=state.metrics,
                             prompt_logprobs=prompt_logprobs)

    @staticmethod
    def _completion(state: RequestState, sequence: _Sequence, delta: bool) -> CompletionOutput:
        index = state.sequences.index(sequence)
        finished = sequence.finish_reason is not None
        if delta:
            start, sequence.num_sent_tokens = sequence.num_sent_tokens, len(sequence.token_ids)
            text = sequence.detokenizer.get_delta(final=finished)
            token_ids = sequence.token_ids[start:]
            logprobs = sequence.logprobs[start:] if sequence.logprobs is not None else None
        else:
            text = sequence.detokenizer.get_text(final=finished)
            token_ids, logprobs = list(sequence.token_ids), sequence.logprobs
        return CompletionOutput(index, text, token_ids, sequence.cumulative_logprob, logprobs,
                                sequence.finish_reason, sequence.stop_reason)
