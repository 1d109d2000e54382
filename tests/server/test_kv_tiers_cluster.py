"""Two real `tokenforge serve` replicas sharing the Redis Cluster that .ci/redis.sh starts."""

from __future__ import annotations

import os

import pytest

from .tier_replicas import check_shared_prefix_ttft, nonce, start_replicas

CLUSTER = os.environ.get("TOKENFORGE_TEST_REDIS_CLUSTER_URL")
pytestmark = pytest.mark.skipif(not CLUSTER, reason="TOKENFORGE_TEST_REDIS_CLUSTER_URL is unset: .ci/redis.sh "
                                                    "starts a 3-master Redis Cluster")


@pytest.fixture(scope="module")
def replicas():
    servers = start_replicas(CLUSTER)
    yield servers
    for s in servers:
        s.stop()


def test_replicas_share_a_prefix_through_the_redis_cluster(replicas):
    a, b = replicas
    r = check_shared_prefix_ttft(a, b, nonce())
    assert r["remote_hits"] >= 1500 // 16
    assert r["text_hit"] == r["text_cold"]
    assert r["ttft_unseen"] >= 3 * r["ttft_hit"], r
