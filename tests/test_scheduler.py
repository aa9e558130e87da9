"""Scheduler behaviour on tiny configs, with a fake runner that samples a fixed token."""

from pagellm.config import SchedulerConfig
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.request import Request, RequestStatus
from pagellm.sampling_params import SamplingParams

TOKEN = 7
EOS = 99


def make_scheduler(num_blocks: int = 16, block_size: int = 4, max_num_seqs: int = 8,
                   budget: int = 64, max_model_len: int = 64, caching: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_model_len=max_model_len)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_caching=caching))


def make_request(request_id: str, num_prompt: int, max_tokens: int = 8, first_token: int = 0,
                 **params) -> Request:
    """Prompts of distinct tokens (unless `first_token` is shared), so caching stays out of the way."""
    start = first_token or 1000 * (sum(map(ord, request_id)) % 50 + 1)
    return Request(request_id, list(range(start, start + num_prompt)), SamplingParams(**params),
                   max_tokens=max_tokens, eos_token_id=EOS)


def plan(output: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_tokens for s in output.scheduled}


def run_step(scheduler: Scheduler, token: int = TOKEN):
    output = scheduler.schedule()
    sampled = {s.request.request_id: [token] * s.num_samples for s in output.scheduled if s.samples}
    updates = scheduler.update_from_output(output, ModelRunnerOutput(sampled=sampled))
    scheduler.check_integrity()
    return output, updates


def test_prompts_are_admitted_fcfs_with_exact_blocks():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 6))
    scheduler.add_request(make_request("b", 3))
    output, updates = run_step(scheduler)
    assert plan(output) == {"a": 6, "b": 3}
    assert scheduler.requests["a"].block_ids == [0, 1]
    assert scheduler.requests["b"].block_ids == [2]
    assert [u.new_token_ids for u in updates] == [[TOKEN], [TOKEN]]
    output, _ = run_step(scheduler)
    assert plan(output) == {"a": 1, "b": 1}
    assert scheduler.requests["b"].block_ids == [2]  # b's 4th token still fits block 2
    run_step(scheduler)
    assert scheduler.requests["b"].block_ids == [2, 3]  # its 5th opens a block
    run_step(scheduler)
    assert scheduler.requests["a"].block_ids == [0, 1, 4]  # a's 9th


def test_long_prompt_is_chunked_and_decodes_are_not_starved():
    scheduler = make_scheduler(budget=8)
    scheduler.add_request(make_request("short", 2))
    output, _ = run_step(scheduler)
    assert plan(output) == {"short": 2}
    scheduler.add_request(make_request("long", 20))
    output, updates = run_step(scheduler)
    assert plan(output) == {"short": 1, "long": 7}
    assert [u.request_id for u in updates] == ["short"]  # a partial chunk samples nothing
    output, _ = run_step(scheduler)
    assert plan(output) == {"short": 1, "long": 7}
    output, updates = run_step(scheduler)
    assert plan(output) == {"short": 1, "long": 6}
    assert {u.request_id for u in updates} == {"short", "long"}


def test_running_prefill_leaves_room_for_decodes_behind_it():
    scheduler = make_scheduler(budget=6)
    scheduler.add_request(make_request("long", 30))
    scheduler.add_request(make_request("d", 2))
    output, _ = run_step(scheduler)
    assert plan(output) == {"long": 6}
    scheduler.running.append(scheduler.waiting.popleft())  # make d a running decode
    d = scheduler.running[-1]
    scheduler.kv.allocate_slots(d, 2)
    d.num_computed_tokens = 1
    output, _ = run_step(scheduler)
    assert plan(output) == {"long": 5, "d": 1}


def test_max_num_seqs_caps_the_running_batch():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, 2))
    output, _ = run_step(scheduler)
    assert plan(output) == {"a": 2, "b": 2}
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_preemption_takes_the_most_recent_and_admits_nothing_that_step():
    scheduler = make_scheduler(num_blocks=3, block_size=4)
    scheduler.add_request(make_request("a", 4))
    scheduler.add_request(make_request("b", 4))
    run_step(scheduler)  # a: [0], b: [1]; each now has 5 tokens
    scheduler.add_request(make_request("c", 1))
    output, _ = run_step(scheduler)
    # a takes block 2 for its 5th token; b then needs a block: b itself is preempted.
    assert plan(output) == {"a": 1}
    assert [r.request_id for r in output.preempted] == ["b"]
    b = scheduler.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert scheduler.num_preemptions == 1
    assert scheduler.requests["a"].block_ids == [0, 2]


def test_preempted_request_recomputes_its_outputs():
    scheduler = make_scheduler(num_blocks=3, block_size=4, caching=False)
    scheduler.add_request(make_request("a", 4, max_tokens=2))
    scheduler.add_request(make_request("b", 4))
    run_step(scheduler)
    run_step(scheduler)  # b is preempted, a finishes (max_tokens=2)
    assert "a" not in scheduler.requests
    output, _ = run_step(scheduler)
    assert plan(output) == {"b": 5}  # prompt + its one output token, recomputed


def test_abort_frees_blocks_at_any_point():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 6))
    scheduler.add_request(make_request("b", 6))
    run_step(scheduler)
    scheduler.add_request(make_request("w", 3))
    scheduler.finish_requests(["a", "w", "unknown"], RequestStatus.FINISHED_ABORTED)
    scheduler.check_integrity()
    assert [r.request_id for r in scheduler.running] == ["b"]
    assert not scheduler.waiting
    assert scheduler.kv.pool.num_free_blocks == 14


def test_stop_conditions():
    scheduler = make_scheduler(max_model_len=8)
    scheduler.add_request(make_request("eos", 2))
    scheduler.add_request(make_request("min", 2, min_tokens=3))
    scheduler.add_request(make_request("ignore", 2, ignore_eos=True, max_tokens=3))
    scheduler.add_request(make_request("stop_id", 2, stop_token_ids=[5]))
    scheduler.add_request(make_request("model_len", 6, max_tokens=100, ignore_eos=True))

    def finished_after_step(token: int) -> dict[str, str]:
        _, updates = run_step(scheduler, token=token)
        return {u.request_id: u.finish_reason for u in updates if u.finished}

    assert finished_after_step(5) == {"stop_id": "stop"}
    assert finished_after_step(EOS) == {"eos": "stop", "model_len": "length"}
    assert finished_after_step(EOS) == {"min": "stop", "ignore": "length"}
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv.pool.num_free_blocks == 16


def test_n_siblings_fork_from_the_prompt_blocks():
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("p", 10, n=3))
    output, updates = run_step(scheduler)
    assert output.scheduled[0].num_samples == 3
    assert [u.request_id for u in updates] == ["p#1", "p#2", "p"]
    parent = scheduler.requests["p"]
    assert parent.block_ids == [0, 1, 2]
    for child_id in ("p#1", "p#2"):
        child = scheduler.requests[child_id]
        assert child.block_ids == [0, 1] and child.num_computed_tokens == 8
        assert child.output_token_ids == [TOKEN]
    assert scheduler.kv.pool.ref_counts[:3] == [3, 3, 1]
    output, _ = run_step(scheduler)
    assert plan(output) == {"p": 1, "p#2": 3, "p#1": 3}
    assert scheduler.requests["p#2"].block_ids == [0, 1, 3]
    assert scheduler.requests["p#1"].block_ids == [0, 1, 4]
