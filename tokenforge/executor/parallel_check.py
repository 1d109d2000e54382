"""Checks of a tensor/pipeline-parallel layout against the model and the host, made before any
process starts or any memory is allocated, each with the fix in its message."""

from __future__ import annotations

from tokenforge.config import EngineConfig


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_experts(config: EngineConfig, arch, tp: int) -> None:
    """Experts split by their intermediate size (each rank a slice), or whole under expert parallelism."""
    moe = arch.moe
    if config.parallel.enable_expert_parallel:
        if moe is None:
            raise ValueError(f"enable_expert_parallel applies to mixture-of-experts models; {arch.architecture} "
                             "has no experts")
        if tp > moe.num_experts:
            raise ValueError(f"--enable-expert-parallel with {tp} ranks needs at least as many experts; the model "
                             f"has {moe.num_experts}")
        return
    if moe is None:
        return
    if moe.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the experts' intermediate size "
                         f"{moe.intermediate_size} (it must be one of {_divisors(moe.intermediate_size)}); or add "
                         "--enable-expert-parallel")
    if moe.expert_format == "mxfp4" and (moe.intermediate_size // tp) % 32:
        raise ValueError(f"tensor_parallel_size {tp} splits the MXFP4 experts' intermediate size "
                         f"{moe.intermediate_size} into slices of {moe.intermediate_size // tp}, not whole groups of "
                         "32; use a smaller tensor_parallel_size or --enable-expert-parallel")


def check_parallel_layout(config: EngineConfig, arch, device: str, local_world_size: int | None = None) -> None:
    tp, pp = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
    heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
    if heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {heads} attention heads "
                         f"(it must be one of {_divisors(heads)})")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size {tp} and the model's {kv_heads} KV heads: one must divide the "
                         f"other (KV heads are split, or replicated when there are fewer than ranks)")
    if arch.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the MLP width {arch.intermediate_size}")
    _check_experts(config, arch, tp)
    if config.cache.kv_tiers_enabled:
        raise ValueError(f"the KV cache tiers (kv_offload_cpu_gb, kv_offload_disk_dir, kv_remote) run with one "
                         f"process only so far, not tensor_parallel_size x pipeline_parallel_size = {tp} x {pp}")
    if pp > arch.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size {pp} is larger than the model's {arch.num_hidden_layers} layers")
    if device == "cuda":
        import torch  # noqa: PLC0415 - device_count reads NVML: no CUDA context is created

        available = torch.cuda.device_count()
        wanted = local_world_size if local_world_size is not None else tp * pp
        if wanted > available:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} needs {wanted} GPUs on "
                             f"this host, but {available} {'is' if available == 1 else 'are'} visible")
