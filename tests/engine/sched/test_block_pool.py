"""BlockPool and KVCacheManager without a model: ref counts, eviction order, prefix hashes."""
from __future__ import annotations

import pytest

from loraplex.engine.sched.block_pool import BlockPool, KVCacheManager, hash_block
from loraplex.engine.request import AdapterRef, Request, SamplingParams

BS = 4


def _req(tokens, rid="r", salt="", adapter=None, max_tokens=4) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), cache_salt=salt,
                   adapter=AdapterRef(adapter, adapter) if adapter else None)


def _compute(kv: KVCacheManager, req: Request, n: int) -> None:
    """What a step does for `req`: reserve blocks for `n` tokens, compute them, publish."""
    assert kv.allocate_slots(req, n)
    prev = req.num_computed_tokens
    req.num_computed_tokens += n
    kv.cache_computed(req, prev)
    kv.pool.check_invariants()


def _admit(kv: KVCacheManager, req: Request) -> int:
    """Admit `req` with its prefix-cache hits and compute the rest; returns the hit tokens."""
    cached, n_cached = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - n_cached, cached)
    req.num_computed_tokens = n_cached
    prev = req.num_computed_tokens
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed(req, prev)
    kv.pool.check_invariants()
    return n_cached


def _free_queue(pool: BlockPool) -> list[int]:
    return list(pool._free)


# -- BlockPool --------------------------------------------------------------------------
def test_allocate_and_free_ref_counts():
    pool = BlockPool(6)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and all(pool.ref_cnt[b] == 1 for b in a)
    assert pool.num_free_blocks == 3 and pool.usage == pytest.approx(0.5)
    pool.check_invariants()
    pool.touch(a[:2])  # a second request shares the first two
    assert [pool.ref_cnt[b] for b in a] == [2, 2, 1]
    pool.free(a)
    assert [pool.ref_cnt[b] for b in a] == [1, 1, 0]
    assert pool.num_free_blocks == 4
    pool.check_invariants()
    pool.free(a[:2])
    assert pool.num_free_blocks == 6 and pool.usage == 0
    pool.check_invariants()


def test_double_free_asserts():
    pool = BlockPool(2)
    a = pool.allocate(1)
    pool.free(a)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(a)
    pool.check_invariants()


def test_allocate_more_than_free_asserts():
    pool = BlockPool(2)
    pool.allocate(2)
    with pytest.raises(AssertionError):
        pool.allocate(1)


def test_touch_pulls_a_free_cached_block_out_of_the_queue():
    pool = BlockPool(3)
    [b] = pool.allocate(1)
    pool.cache(b, b"h")
    pool.free([b])
    assert b in _free_queue(pool) and pool.lookup(b"h") == b
    pool.touch([b])
    assert b not in _free_queue(pool) and pool.ref_cnt[b] == 1
    pool.check_invariants()
    # A touched cached block is never handed out while referenced.
    assert b not in pool.allocate(2)
    pool.check_invariants()


def test_uncached_blocks_handed_out_before_cached():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.cache(blocks[0], b"a")
    pool.cache(blocks[2], b"c")
    pool.free(blocks)
    pool.check_invariants()
    first_two = pool.allocate(2)
    assert set(first_two) == {blocks[1], blocks[3]}, "uncached blocks must go first"
    assert pool.num_evictions == 0
    assert pool.lookup(b"a") == blocks[0] and pool.lookup(b"c") == blocks[2]
    pool.check_invariants()


def test_lru_among_cached_blocks():
    pool = BlockPool(4)
    x, y, z = pool.allocate(3)
    for b, h in ((x, b"x"), (y, b"y"), (z, b"z")):
        pool.cache(b, h)
    pool.free([x])
    pool.free([y])
    pool.free([z])
    pool.touch([x])  # x is used again, so it becomes the most recently freed
    pool.free([x])
    [fresh] = pool.allocate(1)  # the never-cached block goes first
    assert pool.block_hash[fresh] is None and fresh not in (x, y, z)
    assert pool.allocate(1) == [y]
    assert pool.lookup(b"y") is None, "eviction must remove the hash"
    assert pool.allocate(1) == [z]
    assert pool.allocate(1) == [x]
    assert pool.num_evictions == 3
    pool.check_invariants()


def test_a_requests_tail_is_evicted_before_its_head():
    pool = BlockPool(4)
    table = pool.allocate(4)
    for i, b in enumerate(table):
        pool.cache(b, bytes([i]))
    pool.free(table)
    assert _free_queue(pool) == list(reversed(table))
    assert pool.allocate(1) == [table[-1]]
    assert pool.lookup(bytes([0])) == table[0], "the head stays cached"
    pool.check_invariants()


def test_eviction_removes_the_hash_and_counts():
    pool = BlockPool(1)
    [b] = pool.allocate(1)
    pool.cache(b, b"h")
    pool.free([b])
    assert pool.lookup(b"h") == b
    assert pool.allocate(1) == [b]
    assert pool.lookup(b"h") is None and pool.block_hash[b] is None
    assert pool.num_evictions == 1
    pool.check_invariants()


def test_an_identical_block_is_cached_once():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, b"h")
    pool.cache(b, b"h")
    assert pool.lookup(b"h") == a and pool.block_hash[b] is None
    pool.cache(a, b"other")  # a block keeps its first hash
    assert pool.block_hash[a] == b"h"
    pool.free([a, b])
    pool.check_invariants()


def test_prefix_caching_disabled_caches_nothing():
    pool = BlockPool(2, enable_prefix_caching=False)
    [a] = pool.allocate(1)
    pool.cache(a, b"h")
    assert pool.lookup(b"h") is None and pool.block_hash[a] is None


def test_reset_prefix_cache():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache(a, b"a")
    pool.cache(b, b"b")
    pool.free([b])
    pool.reset_prefix_cache()
    assert pool.lookup(b"a") is None and pool.lookup(b"b") is None
    assert pool.block_hash == [None] * 3
    pool.check_invariants()
    pool.free([a])
    pool.check_invariants()


# -- hash_block -------------------------------------------------------------------------
def test_hash_block_is_deterministic_and_keyed_by_everything():
    toks = [1, 2, 3, 4]
    h = hash_block(b"", "t", "d", toks)
    assert h == hash_block(b"", "t", "d", list(toks))
    others = [hash_block(b"p", "t", "d", toks), hash_block(b"", "u", "d", toks),
              hash_block(b"", "t", "e", toks), hash_block(b"", "t", "d", [1, 2, 3, 5]),
              hash_block(b"", "t", "d", toks[:3])]
    assert len({h, *others}) == 6


@pytest.mark.parametrize("a, b", [
    (("a\0b", ""), ("a", "b\0")),  # the separator must not be forgeable from inside a field
    (("a", "b"), ("a\0b", "")),
    (("", "x"), ("x", "")),
])
def test_hash_block_fields_cannot_be_shifted(a, b):
    toks = [7, 8, 9, 10]
    assert hash_block(b"", *a, toks) != hash_block(b"", *b, toks)


def test_hash_block_salt_cannot_forge_token_bytes():
    # Victim: salt "s", adapter "D", first token 65. An attacker-controlled salt that spells
    # the victim's separators and token bytes must not reproduce the victim's hash.
    victim = hash_block(b"", "s", "D", [65, 66])
    forged_salt = "s\0D\0" + "A\0\0\0\0\0"
    assert hash_block(b"", forged_salt, "", [66]) != victim


# -- KVCacheManager ---------------------------------------------------------------------
def test_same_prefix_same_hashes_and_salt_or_adapter_changes_them():
    kv = KVCacheManager(32, BS)
    p = list(range(100, 112))  # three full blocks
    r1, r2 = _req(p + [1, 2], "1"), _req(p + [9], "2")
    salted, adapted = _req(p + [1], "3", salt="tenant-b"), _req(p + [1], "4", adapter="dig")
    for r in (r1, r2, salted, adapted):
        kv.get_computed_blocks(r)
    assert r1.block_hashes == r2.block_hashes and len(r1.block_hashes) == 3
    assert r1.block_hashes[0] != r1.block_hashes[1], "the chain makes equal blocks hash differently"
    for other in (salted, adapted):
        assert len(other.block_hashes) == 3
        assert not set(other.block_hashes) & set(r1.block_hashes)


def test_blocks_are_not_shared_across_tenants_or_adapters():
    kv = KVCacheManager(32, BS)
    p = list(range(100, 113))
    _admit(kv, _req(p, "owner", salt="t1", adapter="A"))
    assert _admit(kv, _req(p, "other-tenant", salt="t2", adapter="A")) == 0
    assert _admit(kv, _req(p, "other-adapter", salt="t1", adapter="B")) == 0
    assert _admit(kv, _req(p, "base-model", salt="t1")) == 0
    assert _admit(kv, _req(p, "same", salt="t1", adapter="A")) == 12


def test_a_prefix_hit_leaves_at_least_one_token_to_compute():
    kv = KVCacheManager(16, BS)
    p = list(range(8))  # exactly two full blocks
    _admit(kv, _req(p, "a"))
    again = _req(p, "b")
    cached, n = kv.get_computed_blocks(again)
    assert n == 4 and len(cached) == 1, "the last block must be recomputed to sample from it"
    longer = _req(p + [99], "c")
    cached, n = kv.get_computed_blocks(longer)
    assert n == 8 and len(cached) == 2


def test_single_token_prompt_never_hits():
    kv = KVCacheManager(4, 1)
    _admit(kv, _req([5], "a"))
    assert kv.get_computed_blocks(_req([5], "b")) == ([], 0)


def test_cache_hits_after_a_request_frees_its_blocks():
    kv = KVCacheManager(8, BS)
    p = list(range(50, 60))  # 2 full blocks + 2 tokens
    first = _req(p, "a")
    _admit(kv, first)
    table = list(first.block_ids)
    kv.free(first)
    assert first.block_ids == [] and kv.pool.num_free_blocks == 8
    kv.pool.check_invariants()
    second = _req(p, "b")
    cached, n = kv.get_computed_blocks(second)
    assert cached == table[:2] and n == 8
    assert kv.allocate_slots(second, second.num_tokens - n, cached)
    assert second.block_ids[:2] == table[:2]
    assert all(kv.pool.ref_cnt[b] == 1 for b in second.block_ids)
    assert kv.num_hits == 8
    kv.pool.check_invariants()
    kv.free(second)
    assert kv.pool.num_free_blocks == 8
    kv.pool.check_invariants()


def test_shared_blocks_are_ref_counted_across_requests():
    kv = KVCacheManager(8, BS)
    p = list(range(9))
    a, b = _req(p, "a"), _req(p + [1, 2], "b")
    _admit(kv, a)
    assert _admit(kv, b) == 8
    assert a.block_ids[:2] == b.block_ids[:2]
    assert [kv.pool.ref_cnt[x] for x in b.block_ids[:2]] == [2, 2]
    kv.free(a)
    assert [kv.pool.ref_cnt[x] for x in b.block_ids[:2]] == [1, 1]
    kv.pool.check_invariants()
    kv.free(b)
    assert kv.pool.num_free_blocks == 8
    kv.pool.check_invariants()


def test_only_computed_full_blocks_are_published():
    kv = KVCacheManager(8, BS)
    r = _req(list(range(10)), "a")
    assert kv.allocate_slots(r, 10)
    assert len(r.block_ids) == 3
    # Reserved but not computed yet: a plan can be dropped (preemption) before it runs.
    assert all(kv.pool.block_hash[b] is None for b in r.block_ids)
    r.num_computed_tokens = 6
    kv.cache_computed(r, 0)
    assert kv.pool.block_hash[r.block_ids[0]] is not None
    assert kv.pool.block_hash[r.block_ids[1]] is None, "a partly computed block is not a hit"
    prev, r.num_computed_tokens = r.num_computed_tokens, 10
    kv.cache_computed(r, prev)
    assert [kv.pool.block_hash[b] is not None for b in r.block_ids] == [True, True, False]
    kv.pool.check_invariants()


def test_allocate_slots_fails_without_changing_anything():
    kv = KVCacheManager(3, BS)
    hog = _req(list(range(8)), "hog")
    _compute(kv, hog, 8)  # 2 blocks, both cached
    r = _req(list(range(100, 112)), "r")  # needs 3
    assert not kv.allocate_slots(r, 12)
    assert r.block_ids == [] and kv.pool.num_free_blocks == 1
    kv.pool.check_invariants()


def test_reclaimable_hits_do_not_count_as_free_space():
    kv = KVCacheManager(3, BS)
    owner = _req(list(range(9)), "owner")
    _compute(kv, owner, 9)  # 3 blocks, the first two cached
    kv.free(owner)
    # Two cached blocks sit in the free queue; a hit on them plus 2 new blocks needs 4.
    r = _req(list(range(8)) + list(range(50, 58)), "r")
    cached, n = kv.get_computed_blocks(r)
    assert n == 8 and kv.pool.num_reclaimable(cached) == 2
    assert not kv.allocate_slots(r, 8, cached)
    assert r.block_ids == [] and all(kv.pool.ref_cnt[b] == 0 for b in cached)
    assert kv.allocate_slots(r, 4, cached)  # a smaller chunk fits: 2 hits + 1 new
    assert len(r.block_ids) == 3 and kv.pool.num_free_blocks == 0
    kv.pool.check_invariants()


def test_decode_growth_allocates_a_block_per_block_size_tokens():
    kv = KVCacheManager(8, BS)
    r = _req([1, 2, 3], "r", max_tokens=8)
    _compute(kv, r, 3)
    sizes = []
    for t in range(6):
        r.output_token_ids.append(t)
        _compute(kv, r, 1)
        sizes.append(len(r.block_ids))
    assert sizes == [1, 2, 2, 2, 2, 3]
    assert kv.blocks_needed(0) == 0 and kv.blocks_needed(4) == 1 and kv.blocks_needed(5) == 2
    kv.free(r)
    kv.pool.check_invariants()


def test_prefix_caching_disabled_manager_never_hits():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    p = list(range(12))
    _admit(kv, _req(p, "a"))
    assert kv.get_computed_blocks(_req(p, "b")) == ([], 0)
