"""The remote tier: KV blocks in Redis or a Redis Cluster, shared by every replica of a model.

In: keys and encoded values. Out: values (bytes) or None. Gets and sets go in pipelined batches;
every set carries a TTL, so `maxmemory-policy volatile-lru` can evict them. Any Redis error or
timeout is counted by kind and turns into misses (the blocks are recomputed); the tier then rests
for a back-off interval and retries by itself, so it resumes when Redis comes back. A Redis that
is unreachable at start-up leaves the tier down, with a warning and a metric, and the server up.
"""

from __future__ import annotations

import time

from tokenforge.config import parse_kv_remote
from tokenforge.executor.tiers.stats import TierCounters

BACKOFF_S = 1.0          # after a failure, the tier is skipped this long before the next try
SOCKET_TIMEOUT_S = 1.0   # a pipelined batch of blocks; a Redis that is up answers in milliseconds
CONNECT_TIMEOUT_S = 0.25 # short: an unreachable host stalls the tier worker at most this long a try


def _error_kind(err: Exception) -> str:
    import redis  # noqa: PLC0415 - redis-py is needed only with --kv-remote

    if isinstance(err, redis.TimeoutError):
        return "remote_timeout"
    if isinstance(err, redis.ConnectionError):
        return "remote_connection"
    if isinstance(err, redis.exceptions.ClusterError | redis.exceptions.RedisClusterException):
        return "remote_cluster"
    return "remote_error"


class RemoteTier:
    name = "remote"

    def __init__(self, url: str, ttl_s: int, counters: TierCounters, *, batch: int = 32) -> None:
        self.url = url
        self.scheme, self.nodes, self.db = parse_kv_remote(url)
        self.ttl_s = ttl_s
        self.batch = batch
        self.counters = counters
        self._client = None
        self._down_until = 0.0
        if self._connect():
            counters.set_remote_up(True)

    @property
    def is_up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _connect(self) -> bool:
        try:
            import redis  # noqa: PLC0415
            from redis.cluster import ClusterNode, RedisCluster  # noqa: PLC0415

            opts = {"socket_timeout": SOCKET_TIMEOUT_S, "socket_connect_timeout": CONNECT_TIMEOUT_S}
            if self.scheme == "redis+cluster":
                client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self.nodes], **opts)
            else:
                client = redis.Redis.from_url(self.url, **opts)
            client.ping()
        except ImportError as e:
            raise ValueError("kv_remote needs redis-py: pip install redis") from e
        except Exception as e:  # noqa: BLE001 - any failure leaves the tier down, never the server
            self._fail(e, "unreachable" if self._client is None else None)
            return False
        self._client = client
        return True

    def _fail(self, err: Exception, kind: str | None = None) -> None:
        self._down_until = time.monotonic() + BACKOFF_S
        self.counters.set_remote_up(False)
        self.counters.fault(kind or _error_kind(err), f"Redis at {self.url}: {type(err).__name__}: {err}")

    def _ready(self) -> bool:
        """Whether to talk to Redis now: not while resting after a failure."""
        if not self.is_up:
            return False
        if self._client is None and not self._connect():
            return False
        return True

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys or not self._ready():
            return [None] * len(keys)
        try:
            out: list[bytes | None] = []
            for i in range(0, len(keys), self.batch):
                pipe = self._client.pipeline(transaction=False)
                for key in keys[i:i + self.batch]:
                    pipe.get(key)
                out.extend(pipe.execute())
        except Exception as e:  # noqa: BLE001 - counted, then recomputed
            self._fail(e)
            return [None] * len(keys)
        self.counters.set_remote_up(True)
        return out

    def put_many(self, items: list[tuple[str, bytes]]) -> int:
        """Set each key with the TTL; returns how many were written (0 when Redis is down)."""
        if not items or not self._ready():
            return 0
        try:
            for i in range(0, len(items), self.batch):
                pipe = self._client.pipeline(transaction=False)
                for key, value in items[i:i + self.batch]:
                    pipe.set(key, value, ex=self.ttl_s)
                pipe.execute()
        except Exception as e:  # noqa: BLE001
            self._fail(e)
            return 0
        self.counters.set_remote_up(True)
        return len(items)

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001
                pass
