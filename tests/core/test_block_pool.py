import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenforge.core.block_pool import BlockPool
from tokenforge.core.hashing import compute_block_hashes, hash_block_tokens

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_new_blocks_come_from_the_front_with_one_reference():
    pool = BlockPool(4, block_size=2)
    assert pool.get_new_blocks(3) == [0, 1, 2]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 0]
    assert pool.num_free_blocks == 1 and pool.usage == 0.75
    with pytest.raises(AssertionError):
        pool.get_new_blocks(2)


def test_reference_counts_never_go_negative():
    pool = BlockPool(2, block_size=2)
    ids = pool.get_new_blocks(1)
    pool.free_blocks(ids)
    with pytest.raises(AssertionError, match="freed more often"):
        pool.free_blocks(ids)


def test_touch_takes_a_free_cached_block_off_the_free_list():
    pool = BlockPool(3, block_size=2)
    [b] = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [5, 6])
    assert pool.cache_block(b, h, [5, 6])
    pool.free_blocks([b])
    assert pool.num_free_blocks == 3 and pool.get_cached_block(h, [5, 6]) == b
    pool.touch([b])
    pool.touch([b])                       # a second request shares it
    assert pool.blocks[b].ref_cnt == 2 and pool.num_free_blocks == 2
    assert b not in pool.free_block_ids()
    pool.free_blocks([b, b])
    assert pool.num_free_blocks == 3 and pool.blocks[b].is_cached


def test_lru_eviction_order_and_hash_kept_until_reuse():
    pool = BlockPool(5, block_size=2)
    ids = pool.get_new_blocks(5)
    hashes = compute_block_hashes(list(range(8)), 2)
    for i, h in enumerate(hashes):           # blocks 0..3 cached, block 4 not
        pool.cache_block(ids[i], h, list(range(2 * i, 2 * i + 2)))
    pool.free_blocks([1, 0])                 # freed first: evicted first
    pool.free_blocks([4])                    # uncached: goes to the front
    pool.free_blocks([3, 2])
    assert pool.free_block_ids() == [4, 1, 0, 3, 2]
    assert pool.num_cached_blocks == 4
    assert pool.get_new_blocks(2) == [4, 1]  # block 1's hash is evicted only now
    assert pool.num_cached_blocks == 3
    assert pool.get_cached_block(hashes[1], [2, 3]) is None
    assert pool.get_cached_block(hashes[0], [0, 1]) == 0


def test_duplicate_or_colliding_hash_keeps_the_first_block():
    pool = BlockPool(3, block_size=2)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, b"h", [1, 2])
    assert not pool.cache_block(b, b"h", [3, 4])       # collision: b stays uncached
    assert pool.get_cached_block(b"h", [3, 4]) is None  # tokens differ: a miss, not a wrong hit
    assert pool.get_cached_block(b"h", [1, 2]) == a
    pool.free_blocks([b, a])
    assert pool.free_block_ids()[0] == b                # uncached b is reused first


def test_caching_disabled_registers_nothing():
    pool = BlockPool(2, block_size=2, enable_caching=False)
    [b] = pool.get_new_blocks(1)
    assert not pool.cache_block(b, b"h", [1, 2])
    assert pool.num_cached_blocks == 0


def test_evict_cached_free_blocks_keeps_blocks_in_use():
    pool = BlockPool(3, block_size=1)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"a", [1])
    pool.cache_block(b, b"b", [2])
    pool.free_blocks([a])
    assert pool.evict_cached_free_blocks() == 1
    assert pool.get_cached_block(b"a", [1]) is None and pool.get_cached_block(b"b", [2]) == b


def test_block_hash_is_chained_salted_and_pinned():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert len(h0) == 32
    assert hash_block_tokens(None, [1, 2, 3, 4], "tenant") != h0
    assert hash_block_tokens(h0, [1, 2, 3, 4]) != h0
    assert compute_block_hashes([1, 2, 3, 4, 5], 4) == [h0]
    # The hash keys shared CPU/disk/Redis tiers: changing it must be a deliberate format bump.
    assert h0.hex().startswith(PINNED_PREFIX)


PINNED_PREFIX = "472cbf46e3b96586"


def test_block_hash_does_not_depend_on_the_process():
    code = ("from tokenforge.core.hashing import hash_block_tokens as h;"
            "print(h(h(None, [1, 2], 's'), [3, 4], 's').hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=REPO_ROOT, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2")}
    assert len(outs) == 1
