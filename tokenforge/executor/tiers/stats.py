"""Counters of the KV tiers, and the rate-limited fault log.

Every fault (a Redis error or timeout, a corrupt value, a full disk...) is counted by cause and
falls back to recompute; one warning line per distinct cause per minute keeps a dead Redis from
flooding the log with a line per request. Updated from the tier threads under one lock.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time

from tokenforge.messages import KVTierStats

logger = logging.getLogger("tokenforge.executor.tiers")

RESTORE_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
WARN_INTERVAL_S = 60.0


class TierCounters:
    def __init__(self, warn_interval: float = WARN_INTERVAL_S) -> None:
        self._lock = threading.Lock()
        self.stats = KVTierStats(restore_bounds=list(RESTORE_BOUNDS), restore_counts=[0] * (len(RESTORE_BOUNDS) + 1))
        self._warn_interval = warn_interval
        self._last_warning: dict[str, float] = {}

    def add(self, field: str, key: str, n: int = 1) -> None:
        with self._lock:
            counts = getattr(self.stats, field)
            counts[key] = counts.get(key, 0) + n

    def observe_restore(self, seconds: float, copy_seconds: float, tokens: int) -> None:
        with self._lock:
            self.stats.restore_counts[bisect.bisect_left(RESTORE_BOUNDS, seconds)] += 1
            self.stats.restore_sum += seconds
            self.stats.restore_copy_sum += copy_seconds
            self.stats.restored_tokens += tokens

    def set_remote_up(self, up: bool | None) -> None:
        self.stats.remote_up = up

    def fault(self, cause: str, detail: str) -> None:
        """Count a fault; log it at most once per cause per interval."""
        self.add("errors", cause)
        now = time.monotonic()
        with self._lock:
            last = self._last_warning.get(cause)
            if last is not None and now - last < self._warn_interval:
                return
            self._last_warning[cause] = now
        logger.warning("KV tier fault (%s): %s; those blocks are recomputed. Further '%s' faults are counted "
                       "in tokenforge:kv_tier_errors_total and logged at most once a minute", cause, detail, cause)

    def snapshot(self) -> KVTierStats:
        with self._lock:
            s = self.stats
            return KVTierStats(dict(s.hits), dict(s.misses), dict(s.bytes_restored), dict(s.puts),
                               dict(s.dropped_puts), dict(s.errors), list(s.restore_bounds),
                               list(s.restore_counts), s.restore_sum, s.restore_copy_sum, s.restored_tokens,
                               s.remote_up)
