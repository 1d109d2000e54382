import pytest

from tokenforge.core import hashing
from tokenforge.core.kv_cache_manager import KVCacheManager
from tokenforge.core.request import Request
from tokenforge.messages import WireSamplingParams


def req(rid: str, tokens: list[int], salt: str | None = None, **params) -> Request:
    return Request(rid, tokens, WireSamplingParams(**params), cache_salt=salt)


def compute(kv: KVCacheManager, r: Request, num_tokens: int | None = None) -> list[int]:
    """Prefix lookup + allocation + 'computation' of the whole (or first num_tokens) request."""
    hits, num_hit = kv.get_computed_blocks(r)
    n = (num_tokens or r.num_tokens) - num_hit
    assert kv.allocate_slots(r, n, hits) is not None
    r.num_computed_tokens = num_hit + n
    kv.cache_blocks(r)
    return kv.block_table(r)


def test_prefix_hit_shares_full_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(8, block_size=4)
    a = req("a", list(range(8)))
    table_a = compute(kv, a)
    assert kv.pool.num_cached_blocks == 2
    b = req("b", list(range(8)))            # identical prompt: only 1 block may be reused
    hits, n = kv.get_computed_blocks(b)
    assert (hits, n) == (table_a[:1], 4)
    c = req("c", list(range(10)))
    hits, n = kv.get_computed_blocks(c)
    assert (hits, n) == (table_a, 8)
    assert kv.allocate_slots(c, 2, hits) is not None
    assert kv.block_table(c)[:2] == table_a and kv.pool.blocks[table_a[0]].ref_cnt == 2
    kv.free(a)
    kv.free(c)
    assert kv.pool.num_free_blocks == 8


def test_lookup_skipped_for_prompt_logprobs_salt_mismatch_or_caching_off():
    kv = KVCacheManager(8, block_size=4)
    compute(kv, req("a", list(range(9))))
    assert kv.get_computed_blocks(req("b", list(range(9)), prompt_logprobs=0)) == ([], 0)
    assert kv.get_computed_blocks(req("c", list(range(9)), salt="other")) == ([], 0)
    off = KVCacheManager(8, block_size=4, enable_caching=False)
    compute(off, req("a", list(range(9))))
    assert off.pool.num_cached_blocks == 0
    assert off.get_computed_blocks(req("b", list(range(9)))) == ([], 0)


def test_allocate_counts_free_prefix_hits_as_unavailable():
    kv = KVCacheManager(5, block_size=4)
    a = req("a", list(range(9)))
    compute(kv, a)
    kv.free(a)                                   # 5 free, 2 of them cached
    other = req("o", [50, 51])
    compute(kv, other)                           # 4 free: the 2 cached + 2 plain
    b = req("b", list(range(8)) + [70] * 9)      # 17 tokens: 2 hit blocks + 3 new
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and kv.pool.num_free_blocks == 4
    before = kv.pool.free_block_ids()
    assert kv.allocate_slots(b, 9, hits) is None  # 3 new > 4 free - 2 taken by the hits
    assert kv.pool.free_block_ids() == before and kv.block_table(b) == []
    assert kv.allocate_slots(b, 8, hits) is not None   # 16 tokens: 2 new blocks fit


def test_hash_collision_never_reuses_a_block_with_other_tokens(monkeypatch):
    monkeypatch.setattr(hashing, "hash_block_tokens", lambda parent, tokens, salt=None: b"same")
    kv = KVCacheManager(8, block_size=4)
    a = req("a", [1, 2, 3, 4, 5])
    table_a = compute(kv, a)
    b = req("b", [9, 9, 9, 9, 5])                # every block hashes to b"same"
    assert kv.get_computed_blocks(b) == ([], 0)
    table_b = compute(kv, b)
    assert table_b[0] != table_a[0]
    assert kv.pool.blocks[table_b[0]].block_hash is None     # the collision was not registered
    kv.free(a)
    kv.free(b)
    c = req("c", [1, 2, 3, 4, 6])                # the real owner of the hash still hits
    assert kv.get_computed_blocks(c) == ([table_a[0]], 4)


def test_blocks_are_cached_incrementally_as_they_fill():
    kv = KVCacheManager(8, block_size=4)
    r = req("r", list(range(6)))
    compute(kv, r, num_tokens=3)
    assert kv.pool.num_cached_blocks == 0    # the lookup hashed block 0; it is not computed yet
    assert kv.allocate_slots(r, 3) == [kv.block_table(r)[1]]
    r.num_computed_tokens = 6
    kv.cache_blocks(r)
    assert kv.pool.num_cached_blocks == 1 and len(r.block_hashes) == 1
    r.append_output_token(42)
    r.append_output_token(43)
    assert kv.allocate_slots(r, 2) == []        # 8 tokens still fit in 2 blocks
    r.num_computed_tokens = 8
    kv.cache_blocks(r)
    assert kv.pool.num_cached_blocks == 2
    assert r.block_hashes == hashing.compute_block_hashes(r.all_token_ids, 4)


def test_usage_and_fragmentation_math():
    kv = KVCacheManager(10, block_size=4)
    assert kv.usage == 0.0 and kv.fragmentation == 0.0
    compute(kv, req("a", list(range(5))))        # 2 blocks, 8 slots, 5 used
    assert kv.usage == pytest.approx(0.2)
    assert kv.fragmentation == pytest.approx(3 / 8)
    compute(kv, req("b", list(range(100, 104))))  # 1 full block
    assert kv.usage == pytest.approx(0.3)
    assert kv.fragmentation == pytest.approx(3 / 12)
    compute(kv, req("c", list(range(5))))        # shares a's full block; its own tail: 1 of 4 used
    assert kv.pool.num_used_blocks == 4
    assert kv.fragmentation == pytest.approx((3 + 3) / 16)


def test_free_leaves_an_outstanding_block_table_intact():
    kv = KVCacheManager(4, block_size=2)
    r = req("r", [1, 2, 3])
    table = compute(kv, r)
    snapshot = list(table)
    kv.free(r)
    assert table == snapshot and kv.block_table(r) == []
    kv.free(r)                                   # freeing twice is a no-op
    assert kv.pool.num_free_blocks == 4
