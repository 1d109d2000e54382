"""Two real `tokenforge serve` replicas sharing one Redis (a private redis-server, so it can be
killed): a prefix computed by one replica is restored by the other, and a Redis killed with
SIGKILL mid-stream costs no client an error; restarted, the tier resumes by itself."""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from .tier_replicas import (RedisProcess, check_shared_prefix, complete, metric_sum, nonce, random_ids,
                            serve_pair, wait_for_metric)

pytestmark = pytest.mark.skipif(not os.environ.get("TOKENFORGE_TEST_REDIS_URL"),
                                reason="TOKENFORGE_TEST_REDIS_URL is unset: .ci/redis.sh installs and starts Redis")


@pytest.fixture(scope="module")
def redis_server():
    server = RedisProcess()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def replicas(redis_server):
    yield from serve_pair(redis_server.url)


def test_replica_b_restores_the_prefix_replica_a_computed(replicas):
    """Through `tokenforge serve` and a standalone Redis: a 640-token prefix (40 blocks) computed
    by A is restored by B, which computes none of it (the engines' counters; see
    check_shared_prefix) and answers with A's tokens. The TTFT this buys (~6-7x idle) was asserted
    here as a 2x floor, which a loaded host could break; tests/executor/test_kv_remote_replicas.py
    checks the 1,500-token prompt of the 3x target in process."""
    a, b = replicas
    check_shared_prefix(a, b, nonce(), prefix_len=640)


def test_redis_sigkill_mid_stream_loses_nothing_and_hits_resume(replicas, redis_server):
    a, b = replicas
    rng = random.Random(nonce())
    prompts = [random_ids(rng, 200) for _ in range(8)]
    with ThreadPoolExecutor(len(prompts)) as pool:      # batched, as the streams below are
        expected = list(pool.map(lambda p: complete(a, p, 6, cache_salt="reference")[0], prompts))
    errors_before = metric_sum(b, "tokenforge:kv_tier_errors_total") + metric_sum(a, "tokenforge:kv_tier_errors_total")
    got: list[str | None] = [None] * len(prompts)

    def stream(i: int) -> None:
        got[i] = complete((a, b)[i % 2], prompts[i], 6)[0]

    threads = []
    for i in range(len(prompts)):
        if i == 3:
            redis_server.kill()
        threads.append(threading.Thread(target=stream, args=(i,)))
        threads[-1].start()
        time.sleep(0.05)
    for t in threads:
        t.join(120)
    assert got == expected                      # every request answered, correctly
    errors = metric_sum(b, "tokenforge:kv_tier_errors_total") + metric_sum(a, "tokenforge:kv_tier_errors_total")
    assert errors > errors_before
    assert metric_sum(b, "tokenforge:kv_tier_remote_up") == 0 or metric_sum(a, "tokenforge:kv_tier_remote_up") == 0
    # Restarted (empty): after the back-off, A's puts land again and B's lookups hit again.
    redis_server.start()
    time.sleep(1.2)
    prefix = random_ids(rng, 320)
    puts0 = metric_sum(a, "tokenforge:kv_tier_puts_total", tier="remote")
    complete(a, prefix + [7], 2)
    assert wait_for_metric(a, "tokenforge:kv_tier_puts_total", puts0 + 20, tier="remote") >= puts0 + 20
    hits0 = metric_sum(b, "tokenforge:kv_tier_hits_total", tier="remote")
    text, _ = complete(b, prefix + [8, 9], 4)
    assert metric_sum(b, "tokenforge:kv_tier_hits_total", tier="remote") >= hits0 + 20
    assert text == complete(a, prefix + [8, 9], 4, cache_salt="cold")[0]
    assert metric_sum(b, "tokenforge:kv_tier_remote_up") == 1
