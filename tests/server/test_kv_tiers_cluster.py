"""Two real `tokenforge serve` replicas sharing the Redis Cluster that .ci/redis.sh starts."""

from __future__ import annotations

import os

import pytest

from .tier_replicas import check_shared_prefix, nonce, serve_pair

CLUSTER = os.environ.get("TOKENFORGE_TEST_REDIS_CLUSTER_URL")
pytestmark = pytest.mark.skipif(not CLUSTER, reason="TOKENFORGE_TEST_REDIS_CLUSTER_URL is unset: .ci/redis.sh "
                                                    "starts a 3-master Redis Cluster")


@pytest.fixture(scope="module")
def replicas():
    yield from serve_pair(CLUSTER)


def test_replicas_share_a_prefix_through_the_redis_cluster(replicas):
    """The cluster's own path (keys spread over three masters, each block's fetch routed to its
    slot's master): B restores A's 40 blocks instead of computing them and answers with A's tokens.
    (Its TTFT, ~6x shorter idle, was asserted here as a 1.5x floor that three redis-servers
    competing for the cores could break; the counters assert what that ratio stood for.)"""
    a, b = replicas
    check_shared_prefix(a, b, nonce(), prefix_len=640)
