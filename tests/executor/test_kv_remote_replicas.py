"""Two engines ("replicas") of the bundled model on one real Redis, with default flags: a prefix
one computed is restored by the other, because a remote tier writes through by default.

What is asserted: the mechanism behind the TTFT target (restored >= 3x faster than unseen; idle
~20x): A computes every token of a prompt it never saw and puts every full block of it when the
request completes; B restores them and computes none of them (its restored-token counter and the
request's `num_cached_tokens`, where its computation starts), with the same greedy output. These
are the engines' own counters, not wall time, which a loaded host could skew. It also reports what
write-through costs (the README and `--help` quote it): the bytes it puts per prompt token, the
Redis memory they take, and the put bandwidth (blocks landed / seconds from the request's end),
and both TTFTs, for information.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from tokenforge import LLM, SamplingParams
from tokenforge.core.hashing import compute_block_hashes

REDIS = os.environ.get("TOKENFORGE_TEST_REDIS_URL")
pytestmark = pytest.mark.skipif(not REDIS, reason="TOKENFORGE_TEST_REDIS_URL is unset (.ci/redis.sh starts Redis)")

BS, PREFIX, SUFFIX = 16, 1500, 12


@pytest.fixture(scope="module")
def replicas():
    engines = [LLM(device="cpu", dtype="float32", kv_remote=REDIS, num_kv_blocks=256, max_model_len=2048, block_size=BS)
               for _ in range(2)]
    yield engines
    for e in engines:
        e.shutdown()


def _timed(llm: LLM, prompt: list[int]) -> tuple[list[int], int, float]:
    """Greedy ids of a one-token request, the prompt tokens the engine did not compute (prefix
    cache and tier hits) and its wall time: the TTFT of an offline engine."""
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return list(out[0].outputs[0].token_ids), out[0].num_cached_tokens, time.perf_counter() - start


def _remote_puts(llm: LLM) -> int:
    return llm.get_stats().kv_tiers.puts.get("remote", 0)


def _settle_puts(llm: LLM, at_least: int, timeout: float = 120.0) -> float:
    start, deadline = time.perf_counter(), time.monotonic() + timeout
    while _remote_puts(llm) < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    return time.perf_counter() - start


def test_a_prefix_one_replica_computed_is_restored_by_the_other_with_default_flags(replicas):
    a, b = replicas
    tiers = a.engine.executor.tiers
    assert a.engine.config.cache.remote_write_through and tiers.write_through     # the default, no flag
    rng = random.Random(time.time_ns())
    for llm in replicas:
        _timed(llm, [rng.randrange(1000, 40000) for _ in range(40)])              # warm each first-request path
    prompt = [rng.randrange(1000, 40000) for _ in range(PREFIX + SUFFIX)]
    full = len(prompt) // BS
    puts0, restored0 = _remote_puts(a), b.get_stats().kv_tiers.restored_tokens
    cold_ids, cold_cached, unseen = _timed(a, prompt)          # A never saw it: it computes every token
    assert cold_cached == 0, cold_cached
    cost = _settle_puts(a, puts0 + full)
    assert _remote_puts(a) >= puts0 + full                     # written through on completion, not on eviction
    assert b.get_stats().kv_tiers.restored_tokens == restored0
    hit_ids, hit_cached, restored_ttft = _timed(b, prompt)
    restored = b.get_stats().kv_tiers.restored_tokens - restored0
    assert restored >= (full - 1) * BS, restored               # B loaded A's blocks ...
    assert hit_cached >= (full - 1) * BS, (hit_cached, restored)   # ... and did not compute them
    assert hit_ids == cold_ids
    client = tiers.remote._client
    key = tiers.codec.key(compute_block_hashes(prompt, BS)[0])
    block_bytes, memory = tiers.mover.block_bytes, client.memory_usage(key)
    print(f"\n[tokenforge] write-through: {block_bytes / BS / 1024:.1f} KiB put per prompt token "
          f"({block_bytes / 1e6:.3f} MB a block), Redis memory {memory / block_bytes:.3f}x the block "
          f"({memory} bytes a key); {full} blocks landed {cost:.3f} s after the request "
          f"(>= {full * block_bytes / max(cost, 1e-3) / 1e6:.0f} MB/s); TTFT unseen {unseen:.3f} s, restored "
          f"{restored_ttft:.3f} s; B computed {len(prompt) - hit_cached} of {len(prompt)} prompt tokens")
    assert memory >= block_bytes and a.get_stats().kv_tiers.dropped_puts == {}
