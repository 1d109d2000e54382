"""Scheduling policy on plain ints and lists: requests, the KV block pool, prefix caching.

Torch-free by rule (tests/test_layering.py and tests/core/test_core_torch_free.py enforce it).
"""

from tokenforge.core.block_pool import BlockPool, KVBlock
from tokenforge.core.hashing import BlockHash, compute_block_hashes, hash_block_tokens
from tokenforge.core.kv_cache_manager import KVCacheManager
from tokenforge.core.outputs import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from tokenforge.core.request import Request, RequestStatus
from tokenforge.core.scheduler import Scheduler

__all__ = [
    "BlockHash", "BlockPool", "KVBlock", "KVCacheManager", "ModelRunnerOutput", "Request",
    "RequestStatus", "ScheduledSequence", "Scheduler", "SchedulerOutput", "compute_block_hashes",
    "hash_block_tokens",
]
