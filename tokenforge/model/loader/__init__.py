"""Model loading: build the model on its device and fill it from the source (tokenforge/source.py
resolves where the weights come from).

In: `model` (None = the bundled GGUF, a .gguf file, an HF directory, a config.json, or a shipped
config name), `load_format` (auto | gguf | safetensors | dummy), dtype, device, seed.
Out: `LoadedModel(model, arch_config, source_path, checksum_hint)`, plus the checkpoint's FP8 KV
cache scales when it has them (kv_scales.py). The checksum hint is a cheap
content fingerprint (sizes plus the first and last MiB of each weight file), enough to notice a
swapped checkpoint without hashing gigabytes at start-up.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tokenforge import envs
from tokenforge.model.arch_config import ArchConfig
from tokenforge.model.loader.dummy_loader import initialize_dummy_weights, read_config_json
from tokenforge.model.loader.gguf_file import GGUFFile
from tokenforge.model.loader.gguf_loader import arch_config_from_gguf, gguf_weights, stored_linear_tensors
from tokenforge.model.loader.kv_scales import KVScaleCollector, kv_scale_target
from tokenforge.model.loader.safetensors_loader import read_hf_config, safetensors_files, safetensors_weights
from tokenforge.model.loader.weight_cache import WeightCache, cache_key
from tokenforge.model.models import get_model_class
from tokenforge.model.quant import QuantOptions, after_loading, before_loading, checkpoint_scheme, linear_layers
from tokenforge.model.quant.gguf_native import attach_gguf_native
from tokenforge.source import LOAD_FORMATS, ModelNotFoundError, ModelSource, find_bundled_gguf, resolve_model_source

logger = logging.getLogger(__name__)

_FINGERPRINT_BYTES = 1 << 20


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    arch_config: ArchConfig
    source_path: Path
    checksum_hint: str
    load_seconds: float = 0.0
    kv_scales: list[tuple[float, float]] | None = None   # per layer (k_scale, v_scale) from the checkpoint


@dataclass(frozen=True, slots=True)
class CacheOptions:
    """Where converted weights are kept (the engine cache) and what else keys them."""

    root: str
    model_version: str | None = None
    quantization: str | None = None


def read_arch_config(model: str | Path | None, load_format: str = "auto") -> ArchConfig:
    """The architecture of a model source without loading its weights (for doctor and sizing)."""
    source = resolve_model_source(model, load_format)
    return _read_arch_config(source, GGUFFile(source.path) if source.config_kind == "gguf" else None)


def load_model(model: str | Path | None, load_format: str, dtype: torch.dtype, device: torch.device | str,
               seed: int = 0, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
               cache: CacheOptions | None = None, quant: QuantOptions | None = None,
               cpu_int8_dynamic: bool = False, expert_parallel: bool = False,
               gguf_native: bool = False) -> LoadedModel:
    """Build the model for this rank on `device` and fill it: from the engine cache when it holds
    this rank's converted weights, else from the source (and then into the cache). `quant` then
    quantizes or prunes it (each rank's shard), and a pre-quantized safetensors checkpoint is
    converted to the kernels' format. The engine cache holds the weights before on-the-fly
    quantization (which runs after every load); a pre-quantized checkpoint bypasses the cache.
    `expert_parallel`: a mixture of experts gives each rank whole experts (layers/moe.py).
    `gguf_native`: a GGUF model on the CPU (one rank, no other quantization) then computes its
    linears from the stored blocks (model/quant/gguf_native.py)."""
    start = time.perf_counter()
    quant = quant or QuantOptions()
    source = resolve_model_source(model, load_format)
    gguf = GGUFFile(source.path) if source.config_kind == "gguf" else None
    config = with_expert_parallel(_read_arch_config(source, gguf), expert_parallel)
    with torch.device(device):
        net = get_model_class(config.architecture)(config, dtype=dtype, tp_rank=tp_rank, tp_size=tp_size,
                                                         pp_rank=pp_rank, pp_size=pp_size)
    prepared = before_loading(net, checkpoint_scheme(source.path) if source.kind == "safetensors" else None, quant)
    checksum = _checksum_hint(source, seed)
    entry = None
    if cache is not None and source.kind != "dummy":
        if prepared.scheme is not None:
            logger.info("engine cache: not used for a pre-quantized checkpoint (%s)", prepared.scheme.label)
        else:
            # expert parallelism shards the experts another way: its own key (through the tp field)
            tp_key = f"{tp_size}-ep" if expert_parallel else tp_size
            entry = WeightCache(cache.root, cache_key(checksum, dtype, cache.quantization, tp_rank, tp_key, pp_rank,
                                                      pp_size, cache.model_version))
    native = gguf is not None and gguf_native and quant.is_empty and tp_size == 1 and torch.device(device).type == "cpu"
    # Without an engine cache (which holds the float weights) the linears computed as stored take
    # their blocks first, so the load never dequantizes them (most of a GGUF's bytes).
    taken = _attach_native(net, gguf, config) if native and entry is None else set()
    from_cache = entry is not None and entry.load_into(net, map_on_cpu=load_format == "lazy")
    if from_cache:
        kv_scales = entry.kv_scales()
    else:
        kv_scales = _fill_from_source(net, source, gguf, config, seed + 1000 * (pp_rank * tp_size + tp_rank), taken)
        if entry is not None:
            entry.store(net, {"source": str(source.path), "checksum": checksum, "dtype": str(dtype),
                              "tp": [tp_rank, tp_size], "pp": [pp_rank, pp_size], "kv_scales": kv_scales})
    after_loading(net, prepared, quant, cpu_int8_dynamic)
    if native and entry is not None:
        _attach_native(net, gguf, config)
    net.eval()
    seconds = time.perf_counter() - start
    logger.info("loaded %s (%s, %s) in %.2f s%s", source.path, source.kind, config.architecture, seconds,
                " from the engine cache" if from_cache else "")
    return LoadedModel(net, config, source.path, checksum, seconds, kv_scales)


def with_expert_parallel(config: ArchConfig, expert_parallel: bool) -> ArchConfig:
    if not expert_parallel:
        return config
    if config.moe is None:
        raise ValueError(f"enable_expert_parallel applies to mixture-of-experts models; {config.architecture} has "
                         "no experts")
    return config.replace(moe=dataclasses.replace(config.moe, expert_parallel=True))


def _attach_native(net: nn.Module, gguf: GGUFFile, config: ArchConfig) -> set[str]:
    layers = linear_layers(net, include_lm_head=True)
    return attach_gguf_native(net, stored_linear_tensors(gguf, config, layers, net.packed_modules))


def _fill_from_source(net: nn.Module, source: ModelSource, gguf: GGUFFile | None, config: ArchConfig,
                      seed: int, computed_as_stored: set[str]) -> list[tuple[float, float]] | None:
    """Fill `net` from the checkpoint (but the GGUF tensors `computed_as_stored`); returns the
    checkpoint's per-layer fp8 KV scales (all layers, whichever stage this rank is), or None."""
    if source.kind == "dummy":
        initialize_dummy_weights(net, seed, stable_greedy=envs.stable_dummy())
    elif gguf is not None:
        net.load_weights(gguf_weights(gguf, config, net.wants_weight, computed_as_stored))
    else:
        collector = KVScaleCollector()
        # KV scales of every layer pass the stage filter: the collector wants them all.
        wanted = lambda name: kv_scale_target(name) is not None or net.wants_weight(name)  # noqa: E731
        net.load_weights(collector.filter(safetensors_weights(source.path, wanted)))
        return collector.per_layer(config.num_hidden_layers)
    return None


def _read_arch_config(source: ModelSource, gguf: GGUFFile | None) -> ArchConfig:
    if gguf is not None:
        return arch_config_from_gguf(gguf)
    if source.config_kind == "hf_dir":
        return read_hf_config(source.path)
    return read_config_json(source.path)


def _checksum_hint(source: ModelSource, seed: int) -> str:
    h = hashlib.sha256(source.kind.encode())
    if source.kind == "dummy":
        config = source.path / "config.json" if source.path.is_dir() else source.path
        h.update(config.read_bytes() if config.suffix == ".json" else str(config.stat().st_size).encode())
        h.update(f"seed={seed}".encode())
        return h.hexdigest()[:16]
    files = [source.path] if source.kind == "gguf" else safetensors_files(source.path)
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(_FINGERPRINT_BYTES))
            f.seek(max(0, size - _FINGERPRINT_BYTES))
            h.update(f.read(_FINGERPRINT_BYTES))
    return h.hexdigest()[:16]


__all__ = ["LOAD_FORMATS", "CacheOptions", "LoadedModel", "ModelNotFoundError", "ModelSource", "find_bundled_gguf", "load_model",
           "read_arch_config", "resolve_model_source"]
