"""The unified memory pool: fixed-size blocks for KV and adapter pages, ref counts,
prefix hashes, one LRU eviction order.

Plain Python, no tensors: the pool hands out block ids; the model runner owns the
memory they index. An adapter resident on the device holds pages (blocks) of the same
pool as KV, so KV and adapters share one budget: while a request uses it its pages are
referenced; once idle they join the free queue like a freed prefix-cached block, and
whichever of the two the LRU order reaches first is evicted (an idle adapter as a whole).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Callable, Iterable

from ..request import Request


def hash_block(parent: bytes, salt: str, adapter: str, tokens: list[int]) -> bytes:
    """Chained block hash keyed by (cache salt, adapter identity, tokens).

    sha256 rather than Python's hash(): a collision here would hand one tenant another
    tenant's KV, so it must not be engineerable.
    """
    h = hashlib.sha256(parent)
    for field in (salt.encode(), adapter.encode()):
        # Length-prefixed, not separated: a salt containing the separator must not be
        # able to spell another (salt, adapter, tokens) key.
        h.update(len(field).to_bytes(8, "little"))
        h.update(field)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockPool:
    """Ref-counted blocks with a free queue in eviction order.

    A freed block keeps its hash (and so stays a prefix-cache hit) until it is handed
    out again. Blocks with no hash are handed out before cached ones. An idle adapter's
    pages wait in the queue the same way, from the moment it went idle; handing out any
    of them evicts the adapter (`on_adapter_evicted` is told) and frees the rest.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # front = evicted first
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.num_evictions = 0
        self.owner: list[str | None] = [None] * num_blocks  # the adapter whose page a block is
        self._pages: dict[str, list[int]] = {}  # resident adapter -> its pages
        self._pinned: set[str] = set()
        self.on_adapter_evicted: Callable[[str], None] | None = None
        self.num_adapter_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def num_reclaimable(self, block_ids: Iterable[int]) -> int:
        """How many of these (cache-hit) blocks currently sit in the free queue."""
        return sum(1 for b in block_ids if self.ref_cnt[b] == 0)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self._free), "caller must check num_free_blocks first"
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            if self.owner[block] is not None:
                self._evict_adapter(self.owner[block])
            old = self.block_hash[block]
            if old is not None:
                # Evict: the block's old content is about to be overwritten.
                if self._cached.get(old) == block:
                    del self._cached[old]
                self.block_hash[block] = None
                self.num_evictions += 1
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the queue."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1

    def free(self, block_ids: list[int]) -> None:
        # Reverse order: a request's tail blocks are the least likely to be shared,
        # so they should be evicted before its head.
        for b in reversed(block_ids):
            assert self.ref_cnt[b] > 0, f"double free of block {b}"
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free[b] = None
                if self.block_hash[b] is None:
                    self._free.move_to_end(b, last=False)

    # -- adapter pages ------------------------------------------------------------
    def adapter_pages(self, digest: str) -> list[int] | None:
        """The pages of a resident adapter, None when it is not resident."""
        return self._pages.get(digest)

    @property
    def num_adapter_pages(self) -> int:
        return sum(len(p) for p in self._pages.values())

    def hold_adapter(self, digest: str, n: int) -> list[int]:
        """Make `digest` resident in `n` pages, pinned (in use). The caller checks
        `num_free_blocks` first; taking pages may evict idle adapters and cached KV."""
        assert digest not in self._pages, f"adapter {digest} is already resident"
        pages = self.allocate(n)
        for b in pages:
            self.owner[b] = digest
        self._pages[digest] = pages
        self._pinned.add(digest)
        return pages

    def pin_adapter(self, digest: str) -> None:
        """An idle resident adapter is in use again: its pages leave the free queue."""
        if digest in self._pinned:
            return
        for b in self._pages[digest]:
            del self._free[b]
            self.ref_cnt[b] = 1
        self._pinned.add(digest)

    def unpin_adapter(self, digest: str) -> None:
        """No request uses `digest` now: its pages join the free queue as the most
        recently used, evictable from then on."""
        self._pinned.discard(digest)
        for b in self._pages[digest]:
            self.ref_cnt[b] = 0
            self._free[b] = None

    def evict_adapter(self, digest: str) -> None:
        """Evict an idle adapter now (its pages become free blocks)."""
        assert digest not in self._pinned, f"adapter {digest} is in use"
        self._evict_adapter(digest)

    def _evict_adapter(self, digest: str) -> None:
        for b in self._pages.pop(digest):
            self.owner[b] = None
            if b in self._free:
                self._free.move_to_end(b, last=False)  # plain free blocks are handed out first
        self.num_adapter_evictions += 1
        if self.on_adapter_evicted is not None:
            self.on_adapter_evicted(digest)

    def cache(self, block_id: int, block_hash: bytes) -> None:
        if not self.enable_prefix_caching or self.block_hash[block_id] is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already cached; keep the first
        self.block_hash[block_id] = block_hash
        self._cached[block_hash] = block_id

    def reset_prefix_cache(self) -> None:
        for h, b in list(self._cached.items()):
            self.block_hash[b] = None
        self._cached.clear()

    def check_invariants(self) -> None:
        """For tests: every block is either referenced or free, never both."""
        for b in range(self.num_blocks):
            assert (self.ref_cnt[b] == 0) == (b in self._free), f"block {b} inconsistent"
        for h, b in self._cached.items():
            assert self.block_hash[b] == h
        for b, h in enumerate(self.block_hash):
            assert h is None or self._cached.get(h) == b, f"block {b} has a hash the cache lost"
            assert self.ref_cnt[b] >= 0
        owned = {b: d for d, pages in self._pages.items() for b in pages}
        for b, d in enumerate(self.owner):
            assert owned.get(b) == d, f"block {b} owner {d} but pages say {owned.get(b)}"
            assert d is None or self.block_hash[b] is None, f"adapter page {b} has a KV hash"
        for d, pages in self._pages.items():
            assert all((self.ref_cnt[b] == 1) == (d in self._pinned) for b in pages), f"adapter {d} pin state"


class KVCacheManager:
    """Per-request block tables over a `BlockPool`, with prefix-cache lookups."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.num_queries = 0  # prefix-cache tokens looked up
        self.num_hits = 0  # prefix-cache tokens hit

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _extend_hashes(self, req: Request, num_tokens: int) -> None:
        bs = self.block_size
        hashes = req.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[i - 1] if i else b""
            hashes.append(hash_block(parent, req.cache_salt, req.adapter_digest, req.token_slice(i * bs, (i + 1) * bs)))

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks; always leaves one token to compute."""
        if not self.enable_prefix_caching or req.sampling.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position's logits
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._extend_hashes(req, max_blocks * self.block_size)
        hits = []
        for h in req.block_hashes[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        self.num_queries += req.num_tokens
        self.num_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give `req` blocks for its next `num_new_tokens` (after any cache hits).

        Returns False, changing nothing, when the pool cannot supply them.
        """
        total = req.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(req.block_ids) - len(cached_blocks)
        available = self.pool.num_free_blocks - self.pool.num_reclaimable(cached_blocks)
        if need > available:
            return False
        if cached_blocks:
            self.pool.touch(cached_blocks)
            req.block_ids.extend(cached_blocks)
        if need > 0:
            req.block_ids.extend(self.pool.allocate(need))
        return True

    def cache_computed(self, req: Request, prev_computed: int) -> None:
        """Publish the full blocks a step computed, `prev_computed` up to `num_computed_tokens`.

        Only after the step ran: a plan can be dropped (preempted) before it executes, and
        a block published at allocation would then be a cache hit over KV nobody wrote.
        """
        if not self.enable_prefix_caching:
            return
        full = req.num_computed_tokens // self.block_size
        self._extend_hashes(req, full * self.block_size)
        for i in range(prev_computed // self.block_size, full):
            self.pool.cache(req.block_ids[i], req.block_hashes[i])

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back `req`'s blocks past what `num_tokens` tokens need (the slots of drafts
        the model rejected). Those blocks hold no published KV: only computed full blocks
        are ever cached."""
        keep = self.blocks_needed(num_tokens)
        if len(req.block_ids) > keep:
            extra = req.block_ids[keep:]
            del req.block_ids[keep:]
            self.pool.free(extra)

    def free(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []

    @property
    def usage(self) -> float:
        return self.pool.usage
