"""The KV tiers' data movement on small CPU tensors: CPU LRU -> disk cascade, checksummed disk
files, Redis and Redis Cluster (the real servers .ci/redis.sh starts), and every fault turning
into a counted miss instead of an error."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import socket
import struct
import threading
import time

import pytest
import torch

from tokenforge.core.outputs import BlockSave, TierLoad
from tokenforge.executor.tiers.blocks import BlockMover
from tokenforge.executor.tiers.codec import HEADER_SIZE, BlockCodec, BlockFormatError
from tokenforge.executor.tiers.disk import DiskTier
from tokenforge.executor.tiers.host import HostTier
from tokenforge.executor.tiers.manager import TierManager
from tokenforge.executor.tiers.remote import RemoteTier
from tokenforge.executor.tiers.stats import TierCounters

REDIS = os.environ.get("TOKENFORGE_TEST_REDIS_URL")
CLUSTER = os.environ.get("TOKENFORGE_TEST_REDIS_CLUSTER_URL")
needs_redis = pytest.mark.skipif(not REDIS, reason="TOKENFORGE_TEST_REDIS_URL is unset (.ci/redis.sh starts Redis)")
needs_cluster = pytest.mark.skipif(not CLUSTER, reason="TOKENFORGE_TEST_REDIS_CLUSTER_URL is unset (.ci/redis.sh)")

NUM_BLOCKS = 12


def kv_caches(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NUM_BLOCKS, 4, 2, 8, generator=g) for _ in range(3)]   # [2, N, bs, H, D] x 3 layers


def block_hash(i: int, nonce: str = "") -> bytes:
    return hashlib.sha256(f"{nonce}/block-{i}".encode()).digest()


def make_manager(kv, tmp_path=None, *, cpu_blocks: int = 0, disk_blocks: int = 0, remote: str | None = None,
                 layout: str = "test-layout"):
    mover = BlockMover(kv, pin=False)
    codec = BlockCodec(layout, mover.block_bytes)
    counters = TierCounters()
    host = HostTier(cpu_blocks, mover.block_shape, mover.dtype, False) if cpu_blocks else None
    disk_bytes = disk_blocks * (mover.block_bytes + HEADER_SIZE)
    disk = DiskTier(str(tmp_path), disk_bytes, codec, counters) if disk_blocks else None
    rem = RemoteTier(remote, 60, counters) if remote else None
    return TierManager(mover, codec, counters, host=host, disk=disk, remote=rem, write_through=True)


def load(manager: TierManager, hashes: list[bytes], block_ids: list[int]) -> list[bool]:
    manager.submit([], [TierLoad("r", hashes, block_ids)])
    for _ in range(500):
        done = manager.poll()
        if done:
            return done[0].found
        manager.wait(0.01)
    raise AssertionError("load never finished")


def settle(manager: TierManager, field: str, tier: str, n: int) -> None:
    for _ in range(500):
        if getattr(manager.counters.stats, field).get(tier, 0) >= n:
            return
        time.sleep(0.01)
    raise AssertionError(f"{field}[{tier}] never reached {n}: {manager.counters.snapshot()}")


def blocks_equal(a: list[torch.Tensor], b: list[torch.Tensor], ids_a: list[int], ids_b: list[int]) -> bool:
    return all(torch.equal(x[:, ids_a], y[:, ids_b]) for x, y in zip(a, b))


def test_codec_round_trip_and_every_rejection_cause():
    codec = BlockCodec("layout-a", 16)
    h = block_hash(1)
    payload = bytes(range(16))
    value = codec.encode(h, payload)
    assert bytes(codec.decode(h, value)) == payload
    assert codec.key(h) == codec.key(h) != BlockCodec("layout-b", 16).key(h)   # never across layouts
    bad_version = value[:4] + struct.pack("<H", 99) + value[6:]
    flipped = value[:-1] + bytes([value[-1] ^ 1])
    cases = {"truncated": value[:40], "bad_magic": b"XXXX" + value[4:], "version": bad_version,
             "layout": BlockCodec("layout-b", 16).encode(h, payload),
             "key_mismatch": codec.encode(block_hash(2), payload),
             "checksum": flipped}
    for cause, data in cases.items():
        with pytest.raises(BlockFormatError) as err:
            codec.decode(h, data)
        assert err.value.cause == cause
    with pytest.raises(BlockFormatError, match="truncated"):
        codec.decode(h, value[:-3])


def test_cpu_lru_cascades_to_disk_and_restores_exactly(tmp_path):
    kv = kv_caches()
    original = [t.clone() for t in kv]
    m = make_manager(kv, tmp_path, cpu_blocks=2, disk_blocks=8)
    hashes = [block_hash(i) for i in range(4)]
    m.submit([BlockSave(b, h) for b, h in zip([1, 2, 3, 4], hashes)], [])
    settle(m, "puts", "cpu", 4)
    settle(m, "puts", "disk", 2)
    assert len(m.host) == 2 and len(m.disk) == 2       # the two least recent went to disk
    assert not [f for f in os.listdir(m.disk.dir) if f.endswith(".tmp")]
    for t in kv:
        t.zero_()
    assert load(m, hashes + [block_hash(99)], [5, 6, 7, 8, 9]) == [True] * 4 + [False]
    assert blocks_equal(kv, original, [5, 6, 7, 8], [1, 2, 3, 4])
    s = m.counters.snapshot()
    assert s.hits == {"cpu": 2, "disk": 2} and s.misses == {"cpu": 3, "disk": 1}
    assert s.bytes_restored["cpu"] == 2 * m.mover.block_bytes and sum(s.restore_counts) == 1
    # A restart finds the disk blocks again (same layout namespace).
    m.shutdown()
    again = make_manager(kv_caches(1), tmp_path, disk_blocks=8)
    assert len(again.disk) == 2
    again.shutdown()


def test_corrupt_disk_file_and_full_disk_fall_back_to_recompute(tmp_path, monkeypatch):
    kv = kv_caches()
    m = make_manager(kv, tmp_path, disk_blocks=8)
    hashes = [block_hash(i) for i in range(3)]
    m.submit([BlockSave(b, h) for b, h in zip([1, 2, 3], hashes)], [])
    settle(m, "puts", "disk", 3)
    path = os.path.join(m.disk.dir, hashes[1].hex() + ".kv")
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 5)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert load(m, hashes, [6, 7, 8]) == [True, False, False]    # the run stops at the corrupt block
    assert m.counters.stats.errors == {"checksum": 1} and not os.path.exists(path)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr("tokenforge.executor.tiers.disk.os.replace", no_space)
    m.submit([BlockSave(4, block_hash(7))], [])
    for _ in range(300):
        if m.counters.stats.errors.get("disk_full"):
            break
        time.sleep(0.01)
    assert m.counters.stats.errors["disk_full"] == 1
    assert not [f for f in os.listdir(m.disk.dir) if f.endswith(".tmp")]
    m.shutdown()


def test_one_warning_per_cause_per_interval(caplog):
    counters = TierCounters()
    with caplog.at_level(logging.WARNING, logger="tokenforge.executor.tiers"):
        for _ in range(5):
            counters.fault("remote_timeout", "slow")
        counters.fault("checksum", "bad")
    assert counters.stats.errors == {"remote_timeout": 5, "checksum": 1}
    assert len(caplog.records) == 2


def test_unreachable_redis_at_start_is_a_down_tier_not_an_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m = make_manager(kv_caches(), remote=f"redis://127.0.0.1:{port}/0")
    s = m.counters.snapshot()
    assert s.remote_up is False and s.errors == {"unreachable": 1}
    assert load(m, [block_hash(1)], [3]) == [False]      # resting: no new error per lookup
    m.shutdown()


def _remote_round_trip(url: str, nonce: str) -> None:
    import redis

    kv = kv_caches()
    writer = make_manager(kv, remote=url)
    hashes = [block_hash(i, nonce) for i in range(5)]
    writer.submit([BlockSave(b, h, remote_only=True) for b, h in zip([1, 2, 3, 4, 5], hashes)], [])
    settle(writer, "puts", "remote", 5)
    client = writer.remote._client
    key = writer.codec.key(hashes[0])
    assert 0 < client.ttl(key) <= 60
    # Another "replica" (same layout, its own memory) restores them; a stranger's layout does not.
    other = [torch.zeros_like(t) for t in kv]
    reader = make_manager(other, remote=url)
    assert load(reader, hashes, [0, 1, 2, 3, 4]) == [True] * 5
    assert blocks_equal(other, kv, [0, 1, 2, 3, 4], [1, 2, 3, 4, 5])
    assert reader.counters.stats.hits == {"remote": 5}
    # Corrupt, truncated and other-version values are counted misses, never loaded.
    keys = [writer.codec.key(h) for h in hashes]
    v1, v2, v3, v4 = (client.get(k) for k in keys[1:])
    client.set(keys[1], v1[:-1] + bytes([v1[-1] ^ 1]), ex=60)
    client.set(keys[2], v2[:100], ex=60)
    client.set(keys[3], v3[:4] + struct.pack("<H", 2) + v3[6:], ex=60)
    client.set(keys[4], v1, ex=60)                          # another block's value under this key
    for i in (1, 2, 3, 4):
        assert load(reader, [hashes[0], hashes[i]], [6, 7]) == [True, False]
    assert reader.counters.stats.errors == {"checksum": 1, "truncated": 1, "version": 1, "key_mismatch": 1}
    assert isinstance(client, redis.RedisCluster) == url.startswith("redis+cluster")
    writer.shutdown()
    reader.shutdown()


@needs_redis
def test_redis_round_trip_ttl_and_bad_values():
    _remote_round_trip(REDIS, f"{os.getpid()}-{time.time_ns()}")


@needs_cluster
def test_redis_cluster_round_trip_ttl_and_bad_values():
    _remote_round_trip(CLUSTER, f"{os.getpid()}-{time.time_ns()}")


def test_slot_runs_batch_consecutive_slots_in_either_order():
    from tokenforge.executor.tiers.blocks import slot_runs

    order, runs = slot_runs([7, 6, 5, 4, 10, 2, 3])
    assert [[7, 6, 5, 4, 10, 2, 3][p] for p in order] == [2, 3, 4, 5, 6, 7, 10]
    assert runs == [(0, 2, 6), (6, 10, 1)]
    assert slot_runs([]) == ([], [])


def test_cpu_tier_load_finds_the_saves_of_its_own_step_without_the_worker(tmp_path, monkeypatch):
    """W9's lost restores: a load must see every block saved before it, even one whose copy is
    still landing, and must not queue behind the worker (disk or Redis jobs)."""
    from tokenforge.executor.tiers.manager import _DiskJob

    kv = kv_caches()
    original = [t.clone() for t in kv]
    m = make_manager(kv, tmp_path, cpu_blocks=8, disk_blocks=8)
    release = threading.Event()
    slow_put = m.disk.put
    monkeypatch.setattr(m.disk, "put", lambda h, p: release.wait(10) and slow_put(h, p))
    m._jobs.put((1, -5, _DiskJob([(block_hash(50), torch.zeros(m.mover.block_shape))])))   # the worker is busy
    hashes = [block_hash(i, "same-step") for i in range(4)]
    # Blocks 4..1 are evicted (tail first, as the pool does) and a request needs them in the same step.
    m.submit([BlockSave(b, h) for b, h in zip([4, 3, 2, 1], reversed(hashes))],
             [TierLoad("r", hashes, [8, 9, 10, 11])])
    done = m.poll()
    assert [d.found for d in done] == [[True] * 4]
    assert blocks_equal(kv, original, [8, 9, 10, 11], [1, 2, 3, 4])
    s = m.counters.snapshot()
    assert s.puts == {"cpu": 4} and s.hits == {"cpu": 4} and s.restored_tokens == 4 * m.mover.block_size
    release.set()
    m.shutdown()
