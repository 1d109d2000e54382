"""KV cache sizing and allocation.

In: the cache config, the model's shape, and (on CUDA) a profiling forward pass. Out: the number
of KV blocks and one preallocated tensor per layer, in the backend's layout. Sizing order:
`num_kv_blocks` if given; else `kv_cache_memory` bytes; else on CUDA `memory_profile=server`
profiles a forward at `max_num_batched_tokens` and fills `gpu_memory_utilization` of the card,
while `client` sizes for `max_num_seqs x max_model_len` only; on the CPU a fixed default budget.
An fp8 cache (e4m3, one byte an element) fits twice the tokens of bf16 in the same budget; its
per-layer K/V scales come from the checkpoint, or else from the calibration pass below (the
profiling pass on CUDA), which records max|k| and max|v| per layer over random tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tokenforge.config import EngineConfig
from tokenforge.kernels.kv_quant import FP8_DTYPE, key_rotation, make_scales, scales_from_amax

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 2**30


@dataclass(slots=True)
class KVSizing:
    num_blocks: int
    weights_bytes: int
    activation_peak_bytes: int
    kv_bytes: int
    block_bytes: int
    kv_dtype: str = "bfloat16"
    capacity_ratio: float = 1.0     # tokens per byte against a cache in the model's dtype
    model_dtype: str = "bfloat16"

    def summary(self, block_size: int, max_model_len: int) -> str:
        tokens = self.num_blocks * block_size
        ratio = f", {self.capacity_ratio:g}x the tokens of a {self.model_dtype} cache" if self.capacity_ratio != 1 else ""
        return (f"weights {self.weights_bytes / 1e9:.2f} GB, activation peak {self.activation_peak_bytes / 1e9:.2f} GB, "
                f"KV cache {self.kv_bytes / 1e9:.2f} GB {self.kv_dtype} = {self.num_blocks} blocks x {block_size} tokens "
                f"({tokens} tokens, {tokens / max_model_len:.1f} concurrent full-length sequences{ratio})")


def kv_bytes_per_block(layers, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across this rank's attention layers (its pipeline stage, its TP heads)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * layer.num_kv_heads * layer.head_dim * elem for layer in layers)


def dtype_name(dtype: torch.dtype) -> str:
    return "fp8 e4m3" if dtype == FP8_DTYPE else str(dtype).removeprefix("torch.")


def allocate_kv_caches(backend, layers, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One cache per attention layer of this rank, holding only this rank's KV heads."""
    return [torch.zeros(backend.kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_dim),
                        dtype=dtype, device=device) for layer in layers]


def _model_bytes(model: torch.nn.Module) -> int:
    # quantized linears keep their packed weights and scales as buffers
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def determine_kv_sizing(runner, config: EngineConfig, max_model_len: int) -> KVSizing:
    cache, sched = config.cache, config.scheduler
    block_bytes = kv_bytes_per_block(runner.kv_layers(), cache.block_size, runner.kv_dtype)
    offloader = getattr(runner, "offloader", None)
    weights = _model_bytes(runner.model) + (offloader.device_bytes if offloader is not None else 0)
    peak = 0
    if cache.num_kv_blocks is not None:
        budget = cache.num_kv_blocks * block_bytes
    elif cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    elif cache.memory_profile == "client" or runner.device.type != "cuda":
        need = sched.max_num_seqs * -(-max_model_len // cache.block_size) * block_bytes
        budget = need if runner.device.type == "cuda" else min(need, CPU_DEFAULT_KV_BYTES)
    else:
        peak = _profile_activation_peak(runner, sched.max_num_batched_tokens)
        total = torch.cuda.get_device_properties(runner.device).total_memory
        used_elsewhere = torch.cuda.mem_get_info(runner.device)[1] - torch.cuda.mem_get_info(runner.device)[0] \
            - torch.cuda.memory_reserved(runner.device)
        budget = int(total * cache.gpu_memory_utilization) - weights - peak - max(0, used_elsewhere)
    num_blocks = cache.num_kv_blocks or budget // block_bytes
    if num_blocks < 1:
        raise ValueError(f"no memory left for the KV cache (budget {budget / 2**30:.2f} GiB after weights "
                         f"{weights / 2**30:.2f} GiB and activations {peak / 2**30:.2f} GiB): raise "
                         "gpu_memory_utilization or kv_cache_memory, or lower max_num_batched_tokens")
    ratio = runner.dtype.itemsize / runner.kv_dtype.itemsize
    return KVSizing(num_blocks, weights, peak, num_blocks * block_bytes, block_bytes, dtype_name(runner.kv_dtype), ratio,
                    dtype_name(runner.dtype))


def kv_scales_for(runner, checkpoint: list[tuple[float, float]] | None) -> list[torch.Tensor] | None:
    """Per-layer fp8 scale vectors from the checkpoint's scales; None: calibrate them."""
    if checkpoint is None:
        return None
    logger.info("fp8 KV cache: per-layer K/V scales from the checkpoint")
    return [make_scales(k, v, runner.device) for k, v in checkpoint]


def rotate_keys(layers, device: torch.device, dtype: torch.dtype) -> None:
    """Calibrated fp8 KV: q and k in a rotated basis (kv_quant.key_rotation). Checkpoint scales
    were measured on unrotated keys, so a checkpoint's scales keep the keys as they are."""
    matrices: dict[int, torch.Tensor] = {}        # one per head_dim, shared by the layers
    for layer in layers:
        if layer.head_dim not in matrices:
            matrices[layer.head_dim] = key_rotation(layer.head_dim, device, dtype)
        layer.kv_rotation = matrices[layer.head_dim]
    logger.info("fp8 KV cache: keys (and queries) stored in a rotated basis, head_dim %s", sorted(matrices))


def start_calibration(layers, device: torch.device) -> None:
    for layer in layers:
        layer.kv_amax = torch.zeros(2, dtype=torch.float32, device=device)


def finish_calibration(layers, device: torch.device) -> list[torch.Tensor]:
    """Scales from the maxima the calibration pass recorded; the layers stop recording."""
    amax = torch.stack([layer.kv_amax for layer in layers]).cpu()     # [L, 2], one host sync
    for layer in layers:
        layer.kv_amax = None
    logger.info("fp8 KV cache: scales calibrated on random tokens (max|k| %.3g, max|v| %.3g over layers)",
                amax[:, 0].max(), amax[:, 1].max())
    return [scales_from_amax(float(k), float(v), device) for k, v in amax.tolist()]


def _profile_activation_peak(runner, num_tokens: int) -> int:
    torch.cuda.synchronize(runner.device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(runner.device)
    before = torch.cuda.memory_allocated(runner.device)
    with torch.inference_mode():
        runner.forward_dummy(num_tokens)
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device) - before
    torch.cuda.empty_cache()
    # The sampler's vocab-sized temporaries for max_num_seqs rows come on top of the forward pass.
    return peak + 4 * runner.config.scheduler.max_num_seqs * runner.vocab_size * 4
