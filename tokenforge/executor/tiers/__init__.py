"""KV cache tiers below the device: pinned CPU memory, local disk and Redis (see manager.py)."""

from __future__ import annotations

import logging
import os
import time

import torch

from tokenforge.config import EngineConfig
from tokenforge.executor.tiers.blocks import BlockMover
from tokenforge.executor.tiers.codec import BlockCodec, layout_string
from tokenforge.executor.tiers.disk import DiskTier
from tokenforge.executor.tiers.host import HostTier
from tokenforge.executor.tiers.manager import TierManager
from tokenforge.executor.tiers.remote import RemoteTier
from tokenforge.executor.tiers.stats import TierCounters

logger = logging.getLogger(__name__)


def model_identity(config: EngineConfig) -> str:
    """What the stored KV depends on besides the layout: the weights (by name and version)."""
    model = config.model
    name = os.path.basename(os.path.normpath(model.model)) if model.model else "bundled"
    ident = f"{name}@{model.model_version or '-'}/{config.load.load_format}/{model.quantization or 'none'}"
    return ident + (f"/seed{model.seed}" if config.load.load_format == "dummy" else "")


def build_tier_manager(config: EngineConfig, kv_caches: list[torch.Tensor], arch,
                       tp_rank: int = 0) -> TierManager:
    cache = config.cache
    mover = BlockMover(kv_caches, cache.pin_memory)
    layout = layout_string(model_id=model_identity(config), dtype=str(mover.dtype).removeprefix("torch."),
                           kv_dtype=cache.kv_cache_dtype, block_size=cache.block_size,
                           num_layers=len(kv_caches), num_kv_heads=arch.num_key_value_heads,
                           head_dim=arch.head_dim, tp_rank=tp_rank,
                           tp_size=config.parallel.tensor_parallel_size)
    codec = BlockCodec(layout, mover.block_bytes)
    counters = TierCounters()
    host = disk = remote = None
    if cache.kv_offload_cpu_gb:
        start = time.perf_counter()
        host = HostTier(_num_blocks("kv_offload_cpu_gb", cache.kv_offload_cpu_gb, mover.block_bytes),
                        mover.block_shape, mover.dtype, mover.pin)
        logger.info("KV tiers: allocated the CPU tier (%.1f GB%s) in %.1f s", host.store.nbytes / 1e9,
                    ", pinned" if mover.pin else "", time.perf_counter() - start)
    if cache.kv_offload_disk_dir:
        _num_blocks("kv_offload_disk_gb", cache.kv_offload_disk_gb, mover.block_bytes)
        disk = DiskTier(cache.kv_offload_disk_dir, int(cache.kv_offload_disk_gb * 1e9), codec, counters)
    if cache.kv_remote:
        remote = RemoteTier(cache.kv_remote, cache.kv_remote_ttl, counters)
    logger.info("KV tiers: %s; block %.2f MB; key namespace %s",
                ", ".join(filter(None, [
                    host is not None and f"cpu {host.num_slots} blocks{' (pinned)' if mover.pin else ''}",
                    disk is not None
                    and f"disk {cache.kv_offload_disk_gb:g} GB in {disk.dir} ({len(disk)} blocks found)",
                    remote is not None and f"remote {cache.kv_remote} ({'up' if remote.is_up else 'DOWN'})"])),
                mover.block_bytes / 1e6, codec.namespace)
    return TierManager(mover, codec, counters, host=host, disk=disk, remote=remote,
                       write_through=cache.remote_write_through)


def _num_blocks(name: str, gb: float, block_bytes: int) -> int:
    n = int(gb * 1e9) // block_bytes
    if n < 1:
        raise ValueError(f"{name}={gb:g} holds no KV block: one block takes {block_bytes / 1e6:.2f} MB")
    return n
