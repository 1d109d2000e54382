"""The engine cache folder (`--engine-cache-dir`): what a restart can reuse.

Today it holds the Triton kernel cache and the torch compile cache, so a warm start skips the JIT
(kernels compiled by the first start are loaded from disk). The folder is taken from the config
and exported before any kernel compiles; worker processes inherit it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tokenforge import envs
from tokenforge.config import EngineConfig

logger = logging.getLogger(__name__)

DEFAULT_ENGINE_CACHE_DIR = envs.cache_home() / "tokenforge" / "engine"


def use_engine_cache(config: EngineConfig) -> Path | None:
    if not config.load.engine_cache_dir:
        return None
    root = Path(config.load.engine_cache_dir).expanduser()
    for sub, var in (("triton", "TRITON_CACHE_DIR"), ("inductor", "TORCHINDUCTOR_CACHE_DIR")):
        (root / sub).mkdir(parents=True, exist_ok=True)
        envs.set(var, str(root / sub))
    logger.info("engine cache: %s (Triton and compile caches)", root)
    return root
