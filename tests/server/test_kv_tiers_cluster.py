"""Two real `tokenforge serve` replicas sharing the Redis Cluster that .ci/redis.sh starts."""

from __future__ import annotations

import os

import pytest

from .tier_replicas import check_shared_prefix_ttft, nonce, serve_pair

CLUSTER = os.environ.get("TOKENFORGE_TEST_REDIS_CLUSTER_URL")
pytestmark = pytest.mark.skipif(not CLUSTER, reason="TOKENFORGE_TEST_REDIS_CLUSTER_URL is unset: .ci/redis.sh "
                                                    "starts a 3-master Redis Cluster")


@pytest.fixture(scope="module")
def replicas():
    yield from serve_pair(CLUSTER)


def test_replicas_share_a_prefix_through_the_redis_cluster(replicas):
    """The cluster's own path (keys spread over three masters); the 1,500-token TTFT target is
    test_kv_tiers_live's, so a 640-token prefix (40 blocks over the masters) keeps this one short."""
    a, b = replicas
    check_shared_prefix_ttft(a, b, nonce(), prefix_len=640)
