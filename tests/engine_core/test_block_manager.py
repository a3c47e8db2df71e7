"""BlockManager: reference counts, prefix-cache hits, LRU eviction, reset.

Pure python. A request's tokens are "computed" by allocating slots for them
and then advancing num_computed_tokens, as the scheduler does.
"""

from __future__ import annotations

import itertools

import pytest

from pagoda.engine_core.core.block_manager import BlockManager
from pagoda.engine_core.core.request import Request
from pagoda.protocol.sampling_params import SamplingParams

BLOCK_SIZE = 4
_ids = itertools.count()


def make_request(token_ids: list[int], lora_name: str | None = None) -> Request:
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=token_ids,
        sampling_params=SamplingParams(),
        eos_token_ids=[],
        arrival_time=0.0,
        lora_name=lora_name,
    )


def admit(bm: BlockManager, request: Request) -> int:
    """Take the request's cached prefix, allocate the rest, compute it; returns the hit length."""
    computed, num_hit = bm.get_computed_blocks(request)
    assert bm.allocate_slots(request, request.num_tokens - num_hit, computed)
    request.num_computed_tokens = request.num_tokens
    bm.check_invariants()
    return num_hit


def cached_prefix_len(bm: BlockManager, token_ids: list[int], lora_name: str | None = None) -> int:
    """How many leading tokens of `token_ids` the cache would serve now (changes nothing)."""
    probe = make_request(token_ids, lora_name)
    _, num_hit = bm.get_computed_blocks(probe)
    bm.free(probe)  # drops the probe's hash bookkeeping; it holds no blocks
    bm.check_invariants()
    return num_hit


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_allocate_grow_and_free_counts_blocks() -> None:
    bm = BlockManager(num_blocks=10, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    request = make_request(seq(0, 10))
    admit(bm, request)
    blocks = bm.get_block_ids(request.request_id)
    assert len(blocks) == 3  # ceil(10 / 4)
    assert all(bm.blocks[b].ref_cnt == 1 for b in blocks)
    assert bm.num_free_blocks == 7

    # Decode: a new block only when the last one is full.
    for expected_blocks in (3, 3, 4, 4, 4, 4, 5):
        request.append_output_token(7)
        assert bm.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        bm.check_invariants()
        assert len(bm.get_block_ids(request.request_id)) == expected_blocks
    assert bm.num_free_blocks == 5

    bm.free(request)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert all(block.ref_cnt == 0 for block in bm.blocks)
    assert bm.get_block_ids(request.request_id) == []


def test_failed_allocation_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    holder = make_request(seq(0, 4))
    admit(bm, holder)
    too_big = make_request(seq(100, 9))  # needs 3 blocks, 2 are free
    computed, num_hit = bm.get_computed_blocks(too_big)
    assert not bm.allocate_slots(too_big, too_big.num_tokens - num_hit, computed)
    bm.check_invariants()
    assert bm.num_free_blocks == 2
    assert bm.get_block_ids(too_big.request_id) == []

    # A running request that cannot grow keeps what it had.
    holder.append_output_token(1)
    assert bm.allocate_slots(holder, 1)
    assert not bm.allocate_slots(holder, 2 * BLOCK_SIZE + 1)
    bm.check_invariants()
    assert len(bm.get_block_ids(holder.request_id)) == 2


def test_shared_prefix_shares_blocks_with_ref_counts() -> None:
    bm = BlockManager(num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    prefix = seq(0, 3 * BLOCK_SIZE)
    first = make_request(prefix + [900, 901, 902])
    assert admit(bm, first) == 0
    second = make_request(prefix + [800, 801, 802, 803, 804])
    assert admit(bm, second) == 3 * BLOCK_SIZE

    shared = bm.get_block_ids(first.request_id)[:3]
    assert bm.get_block_ids(second.request_id)[:3] == shared
    assert all(bm.blocks[b].ref_cnt == 2 for b in shared)
    assert bm.num_free_blocks == 16 - 4 - 2  # first: 4 blocks; second: 2 of its own
    assert bm.num_prefix_hits == 3 * BLOCK_SIZE

    bm.free(first)
    bm.check_invariants()
    assert all(bm.blocks[b].ref_cnt == 1 for b in shared)
    bm.free(second)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_the_last_prompt_token_is_always_computed() -> None:
    """A fully cached prompt still leaves one token, so that there are logits to sample."""
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    prompt = seq(0, 2 * BLOCK_SIZE)
    admit(bm, make_request(prompt))
    again = make_request(prompt)
    assert admit(bm, again) == BLOCK_SIZE  # not 2 blocks: the last one is recomputed


def test_freed_blocks_stay_cached_until_reused() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    prompt = seq(0, 2 * BLOCK_SIZE + 1)
    first = make_request(prompt)
    admit(bm, first)
    first_blocks = bm.get_block_ids(first.request_id)[:2]
    bm.free(first)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks  # cached-but-free counts as free

    again = make_request(prompt)
    assert admit(bm, again) == 2 * BLOCK_SIZE
    assert bm.get_block_ids(again.request_id)[:2] == first_blocks
    # Taking the idle cached blocks costs free capacity like fresh ones.
    assert bm.num_free_blocks == bm.num_blocks - 3


def test_lora_name_and_disabled_cache_give_no_hits() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    prompt = seq(0, 2 * BLOCK_SIZE + 1)
    admit(bm, make_request(prompt, lora_name="a"))
    assert cached_prefix_len(bm, prompt, lora_name="a") == 2 * BLOCK_SIZE
    assert cached_prefix_len(bm, prompt, lora_name="b") == 0
    assert cached_prefix_len(bm, prompt) == 0

    off = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    admit(off, make_request(prompt))
    assert admit(off, make_request(prompt)) == 0


def test_eviction_is_lru_and_takes_tails_first() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    older = seq(0, 2 * BLOCK_SIZE + 1)  # 2 full blocks (cached) + 1 partial
    newer = seq(100, 2 * BLOCK_SIZE + 1)
    first, second = make_request(older), make_request(newer)
    admit(bm, first)
    admit(bm, second)
    bm.free(first)  # freed first: evicted first
    bm.free(second)
    bm.check_invariants()

    def hits() -> tuple[int, int]:
        return cached_prefix_len(bm, older), cached_prefix_len(bm, newer)

    assert hits() == (8, 8)
    # Never-used and uncached (partial) blocks go before any cached one.
    admit(bm, make_request(seq(200, 3 * BLOCK_SIZE)))
    assert hits() == (8, 8)
    # Then the least recently freed request, its tail block before its head.
    admit(bm, make_request(seq(300, 2 * BLOCK_SIZE)))
    assert hits() == (4, 8)
    admit(bm, make_request(seq(400, BLOCK_SIZE)))
    assert hits() == (0, 8)
    admit(bm, make_request(seq(500, BLOCK_SIZE)))
    assert hits() == (0, 4)
    assert bm.num_free_blocks == 1


def test_reset_prefix_cache_forgets_only_idle_blocks() -> None:
    bm = BlockManager(num_blocks=12, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    idle_prompt = seq(0, 2 * BLOCK_SIZE + 1)
    held_prompt = seq(100, 3 * BLOCK_SIZE + 1)
    idle = make_request(idle_prompt)
    admit(bm, idle)
    bm.free(idle)
    held = make_request(held_prompt)
    admit(bm, held)

    assert bm.reset_prefix_cache() == 2  # the idle request's two full blocks
    bm.check_invariants()
    assert cached_prefix_len(bm, idle_prompt) == 0
    # Blocks a running request holds keep serving hits.
    assert cached_prefix_len(bm, held_prompt) == 3 * BLOCK_SIZE
    assert bm.num_free_blocks == 12 - 4

    bm.free(held)
    assert bm.reset_prefix_cache() == 3
    bm.check_invariants()
    assert cached_prefix_len(bm, held_prompt) == 0
    assert bm.cached_blocks == {}
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_usage_tracks_held_blocks(enable_prefix_caching: bool) -> None:
    bm = BlockManager(
        num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching
    )
    request = make_request(seq(0, 2 * BLOCK_SIZE))
    assert bm.usage == 0.0
    admit(bm, request)
    assert bm.usage == pytest.approx(2 / 8)
    bm.free(request)
    assert bm.usage == 0.0
