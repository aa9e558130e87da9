import pytest

from pagellm.core.block_pool import BlockPool
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams


def make_request(request_id: str, num_tokens: int) -> Request:
    return Request(request_id, list(range(num_tokens)), SamplingParams(), max_tokens=16)


def test_blocks_come_from_the_front_and_return_to_the_back():
    pool = BlockPool(4)
    assert pool.get_new_blocks(3) == [0, 1, 2]
    pool.free_blocks([1])
    assert pool.get_new_blocks(2) == [3, 1]
    assert pool.num_free_blocks == 0
    pool.check_integrity([[0, 2, 3, 1]])


def test_over_allocation_and_double_free_are_errors():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(3)
    blocks = pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(RuntimeError):
        pool.free_blocks(blocks)
    pool.check_integrity()


def test_shared_blocks_are_freed_by_their_last_holder():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.touch(blocks)
    pool.check_integrity([blocks, blocks])
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 1
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 3
    pool.check_integrity()


def test_integrity_check_catches_refcount_mismatch():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(AssertionError):
        pool.check_integrity([blocks[:1]])


def test_allocate_slots_hands_out_blocks_as_tokens_arrive():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("a", 6)
    assert manager.num_blocks_needed(request, 6) == 2
    assert manager.allocate_slots(request, 6) == [0, 1]
    request.num_computed_tokens = 6
    assert manager.allocate_slots(request, 2) == []  # slots 6 and 7 fit in block 1
    request.num_computed_tokens = 8
    assert manager.allocate_slots(request, 1) == [2]
    assert request.block_ids == [0, 1, 2]
    manager.check_integrity([request])


def test_free_returns_tail_first():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    first, second = make_request("a", 6), make_request("b", 2)
    manager.allocate_slots(first, 6)
    manager.allocate_slots(second, 2)
    manager.free(first)
    assert first.block_ids == []
    third = make_request("c", 8)
    assert manager.allocate_slots(third, 6) == [2, 1, 0]
    manager.check_integrity([second, third])


def test_can_allocate_matches_free_blocks():
    manager = KVCacheManager(num_blocks=2, block_size=4)
    request = make_request("a", 9)
    assert not manager.can_allocate(request, 9)
    assert manager.can_allocate(request, 8)


def test_fork_shares_full_prompt_blocks_only():
    manager = KVCacheManager(num_blocks=6, block_size=4)
    parent = make_request("p", 10)
    manager.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    child = make_request("p#1", 10)
    manager.fork(parent, child)
    assert child.block_ids == [0, 1]
    assert child.num_computed_tokens == 8
    manager.check_integrity([parent, child])
    manager.free(parent)
    manager.check_integrity([child])
    assert manager.pool.num_free_blocks == 4
