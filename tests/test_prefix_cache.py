"""Prefix caching: hash chains, exact block reuse, LRU eviction order, salt isolation."""

from pagellm.config import SchedulerConfig
from pagellm.core.kv_cache_manager import KVCacheManager, hash_block
from pagellm.core.sched_output import ModelRunnerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.request import Request, RequestStatus
from pagellm.sampling_params import SamplingParams

BLOCK = 4


def make_request(request_id: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(request_id, list(tokens), SamplingParams(), max_tokens=4, cache_salt=salt)


def make_scheduler(num_blocks: int = 8) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK))


def prefill(scheduler: Scheduler, request: Request) -> None:
    """Admit `request`, run its prompt, then finish it so its blocks stay only as cache."""
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput(sampled={request.request_id: [1]}))
    scheduler.check_integrity()


def test_hashes_chain_through_the_prefix():
    manager = KVCacheManager(8, BLOCK)
    first = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    second = make_request("b", [0, 2, 3, 4, 5, 6, 7, 8])
    manager.hash_new_blocks(first)
    manager.hash_new_blocks(second)
    assert len(first.block_hashes) == 2 and len(second.block_hashes) == 2
    assert first.block_hashes[0] == hash_block(None, [1, 2, 3, 4], None)
    assert first.block_hashes[1] == hash_block(first.block_hashes[0], [5, 6, 7, 8], None)
    assert first.block_hashes[1] != second.block_hashes[1]  # same tokens, other parent


def test_a_new_request_reuses_the_exact_cached_blocks():
    scheduler = make_scheduler()
    first = make_request("a", list(range(10)))
    prefill(scheduler, first)
    assert first.block_ids == [0, 1, 2]
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    second = make_request("b", list(range(8)) + [42, 43, 44])
    scheduler.add_request(second)
    output = scheduler.schedule()
    assert second.block_ids == [0, 1, 3]
    assert (output.scheduled[0].start, output.scheduled[0].num_tokens) == (8, 3)
    kv = scheduler.kv
    assert (kv.prefix_queries, kv.prefix_hits) == (10 + 11, 8)
    scheduler.check_integrity()


def test_the_last_token_is_always_computed():
    scheduler = make_scheduler()
    prefill(scheduler, make_request("a", list(range(8))))
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    again = make_request("b", list(range(8)))
    scheduler.add_request(again)
    output = scheduler.schedule()
    assert again.block_ids[0] == 0 and again.num_computed_tokens == 4
    assert output.scheduled[0].num_tokens == 4


def test_running_requests_share_cached_blocks():
    scheduler = make_scheduler()
    prefill(scheduler, make_request("a", list(range(9))))
    other = make_request("b", list(range(9)))
    scheduler.add_request(other)
    scheduler.schedule()
    assert other.block_ids[:2] == [0, 1]
    assert scheduler.kv.pool.ref_counts[:3] == [2, 2, 1]
    scheduler.check_integrity()


def test_unused_cached_blocks_are_evicted_lru_tail_first():
    scheduler = make_scheduler(num_blocks=5)
    pool = scheduler.kv.pool
    prefill(scheduler, make_request("a", list(range(12))))
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert pool.free_queue() == [3, 4, 2, 1, 0]  # never used first, then a's blocks tail first
    prefill(scheduler, make_request("b", [100, 101]))
    assert scheduler.requests["b"].block_ids == [3]
    prefill(scheduler, make_request("c", list(range(200, 209))))
    assert scheduler.requests["c"].block_ids == [4, 2, 1]  # a's tail goes before its head
    assert pool.get_cached_block(hash_block(None, [0, 1, 2, 3], None)) == 0
    assert pool.num_evictions == 2
    scheduler.check_integrity()


def test_cache_salt_isolates_tenants():
    scheduler = make_scheduler()
    prefill(scheduler, make_request("a", list(range(9)), salt="tenant-1"))
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    for request_id, salt, hit_blocks in (("b", "tenant-2", 0), ("c", None, 0), ("d", "tenant-1", 2)):
        request = make_request(request_id, list(range(9)), salt=salt)
        scheduler.add_request(request)
        assert len(scheduler.kv.get_computed_blocks(request)) == hit_blocks
        scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
    scheduler.check_integrity()


def test_reclaimed_cached_blocks_count_against_free_space():
    manager = KVCacheManager(3, BLOCK)
    holder = make_request("a", list(range(9)))
    manager.hash_new_blocks(holder)
    manager.allocate_slots(holder, 9)
    manager.free(holder)
    request = make_request("b", list(range(9)) + list(range(50, 55)))
    manager.hash_new_blocks(request)
    computed = manager.get_computed_blocks(request)
    assert computed == [0, 1]
    # Blocks 0 and 1 come back from the free queue: only block 2 is left for new tokens.
    assert manager.can_allocate(request, 4, computed)
    assert not manager.can_allocate(request, 5, computed)
