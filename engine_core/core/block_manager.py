"""BlockManager: fixed-size KV blocks, reference counts, prefix caching.

Imports no torch. The free list is an ordered dict that is also the LRU
eviction order: a freed block goes to the back and keeps its prefix-cache
hash until a new allocation takes it from the front. A full block is cached
under a chained hash of (parent hash, its token ids, the LoRA adapter's
name and registration id), so two requests that share a prefix and an
adapter share its blocks; different adapters never do.
"""

from __future__ import annotations

from collections import OrderedDict

from pagoda.engine_core.core.kv_offload import HostTier
from pagoda.engine_core.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVBlock:
    """One block of the paged KV cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None


class BlockManager:
    """Hands out KV blocks to requests and keeps the prefix cache."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        host_tier: HostTier | None = None,
    ) -> None:
        """`host_tier`: evicted prefix blocks are kept there and found again
        (core/kv_offload.py)."""
        self.host_tier = host_tier if enable_prefix_caching else None
        # Per request: the prefix blocks get_computed_blocks found in the host
        # tier (their hashes), which allocate_slots brings back.
        self._host_hits: dict[str, list[int]] = {}
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_blocks: dict[int, int] = {}  # block hash -> block id
        self.req_blocks: dict[str, list[int]] = {}
        self.req_block_hashes: dict[str, list[int]] = {}
        self.req_num_cached_blocks: dict[str, int] = {}
        self.num_prefix_queries = 0  # tokens looked up
        self.num_prefix_hits = 0  # tokens found

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free counts as free)."""
        return 1.0 - len(self.free_blocks) / self.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Blocks of the request's prefix that are already in the cache.

        At least one token is always left to compute, so that the step that
        finishes the prompt produces logits to sample from.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        hits: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        # Past the device cache, the host tier may hold the next blocks.
        kept: list[int] = []
        tier = self.host_tier
        if tier is not None:
            for block_hash in hashes[len(hits) : max_blocks]:
                if block_hash not in tier:
                    break
                kept.append(block_hash)
        if kept:
            self._host_hits[request.request_id] = kept
        num_hit = (len(hits) + len(kept)) * self.block_size
        self.num_prefix_queries += request.num_tokens
        self.num_prefix_hits += num_hit
        return hits, num_hit

    # -------------------------------------------------------------- allocation

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_block_ids: list[int] | None = None
    ) -> bool:
        """Make room for `num_new_tokens` more tokens; False if blocks are short.

        `computed_block_ids` are prefix-cache hits (from get_computed_blocks)
        taken over by a request that has no blocks yet.
        """
        computed = computed_block_ids or []
        # Blocks found in the host tier: fresh device blocks, loaded before the step.
        kept = self._host_hits.pop(request.request_id, []) if computed_block_ids is not None else []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + (len(computed) + len(kept)) * self.block_size
        num_total = num_computed + num_new_tokens
        num_needed = cdiv(num_total, self.block_size) - len(blocks) - len(computed)
        # Cached blocks that nobody holds sit in the free list: taking them
        # costs free capacity just like a fresh block.
        num_idle_hits = sum(1 for b in computed if self.blocks[b].ref_cnt == 0)
        if max(num_needed, 0) + num_idle_hits > len(self.free_blocks):
            if not blocks:
                del self.req_blocks[request.request_id]
            return False
        for block_id in computed:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_blocks[block_id]
            block.ref_cnt += 1
            blocks.append(block_id)
        if kept:
            tier = self.host_tier
            assert tier is not None
            tier.reserved = set(kept)  # the pops below may save evicted blocks
            fresh = [self._pop_free_block() for _ in kept]
            tier.reserved = set()
            for block_hash, block_id in zip(kept, fresh, strict=True):
                tier.load(block_hash, block_id)
            blocks.extend(fresh)
        for _ in range(num_needed - len(kept)):
            blocks.append(self._pop_free_block())
        if self.enable_prefix_caching:
            # Only positions holding the request's real tokens: speculative
            # drafts past them may be rejected, their KV rewritten later.
            self._cache_full_blocks(request, min(num_total, request.num_tokens))
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks; cached ones stay findable until reused."""
        self.release(request.request_id)

    def hold(self, request_id: str, key: str) -> None:
        """Keep a finished request's blocks under `key` (for a KV consumer to
        read) until `release(key)`; they count as used meanwhile."""
        self.req_blocks[key] = self.req_blocks.pop(request_id, [])
        self.req_block_hashes.pop(request_id, None)
        self.req_num_cached_blocks.pop(request_id, None)

    def uncache(self, request_id: str, first_block: int) -> None:
        """Take the request's blocks from `first_block` on out of the prefix
        cache (their content never arrived: a failed KV pull)."""
        for block_id in self.req_blocks.get(request_id, [])[first_block:]:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self.cached_blocks.get(block.block_hash) == block_id:
                    del self.cached_blocks[block.block_hash]
                block.block_hash = None
        self.req_block_hashes.pop(request_id, None)
        self.req_num_cached_blocks.pop(request_id, None)

    def release(self, key: str) -> None:
        """Release the blocks a request (or a hold) has."""
        blocks = self.req_blocks.pop(key, [])
        self.req_block_hashes.pop(key, None)
        self.req_num_cached_blocks.pop(key, None)
        # Tail blocks first, so that the shared prefix is evicted last.
        for block_id in reversed(blocks):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_blocks[block_id] = None
                if block.block_hash is None:
                    # Nothing reusable in it: hand it out before cached ones.
                    self.free_blocks.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no request holds (and the host tier's);
        returns how many device blocks."""
        if self.host_tier is not None:
            self.host_tier.clear()
        dropped = 0
        for block_id in self.free_blocks:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self.cached_blocks.get(block.block_hash) == block_id:
                    del self.cached_blocks[block.block_hash]
                block.block_hash = None
                dropped += 1
        return dropped

    # ---------------------------------------------------------------- internals

    def _pop_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) == block_id:
                del self.cached_blocks[block.block_hash]
                if self.host_tier is not None:  # kept in host memory before it is reused
                    self.host_tier.save(block_id, block.block_hash)
            block.block_hash = None
        block.ref_cnt = 1
        return block_id

    def _block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Chained hashes of the request's first `num_blocks` full blocks."""
        hashes = self.req_block_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        tokens = request.all_token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            block = tuple(tokens[i * bs : (i + 1) * bs])
            hashes.append(hash((parent, block, request.lora_cache_key)))
        return hashes

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        start = self.req_num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        blocks = self.req_blocks[request.request_id]
        for i in range(start, num_full):
            block = self.blocks[blocks[i]]
            if block.block_hash is None and hashes[i] not in self.cached_blocks:
                block.block_hash = hashes[i]
                self.cached_blocks[hashes[i]] = block.block_id
        self.req_num_cached_blocks[request.request_id] = num_full

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (tests call this every step)."""
        held: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            assert len(blocks) == len(set(blocks)), "a request holds a block twice"
            for block_id in blocks:
                held[block_id] = held.get(block_id, 0) + 1
        for block in self.blocks:
            expected = held.get(block.block_id, 0)
            assert block.ref_cnt == expected, (
                f"block {block.block_id} ref {block.ref_cnt} != {expected}"
            )
            assert (block.ref_cnt == 0) == (block.block_id in self.free_blocks), (
                f"block {block.block_id} free-list membership disagrees with ref_cnt"
            )
        for block_hash, block_id in self.cached_blocks.items():
            assert self.blocks[block_id].block_hash == block_hash, "cache map out of sync"
        assert len(self.free_blocks) + len(held) == self.num_blocks
