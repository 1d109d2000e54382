"""What the engine core settles before it loads anything: the device, the batch limits that depend
on it, and whether the weights fit.

`serve`'s API process sends an `EngineConfig.unresolved` config (no torch there, no CUDA probe, no
CUDA context); the core resolves it here and sends the result back with `Ready`, and the API
process takes its limits from that. A refusal (cuda where there is none, weights that cannot fit)
is a `StartupRefused`: the core reports it as such, before any log line, and `serve` prints it as
the one-line error of a bad flag (exit 2), as it did when these checks ran in the API process.
The offline `LLM` runs the same function in-process (EngineCore does).
"""

from __future__ import annotations

from tokenforge import envs
from tokenforge.config import EngineConfig


class StartupRefused(ValueError):
    """The config cannot run on this machine: refused before anything is allocated."""


def resolve_engine_config(config: EngineConfig) -> EngineConfig:
    """The device resolved and named, unset batch limits filled for it, and the fit of the weights
    checked (planning.fit.check_fit: the doctor's arithmetic). Idempotent."""
    # The fit check reads the GPU's memory, which initialises CUDA, and with it the allocator,
    # which reads its settings then: the executor's must be in place first.
    envs.set_default("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        device = config.device.resolved_device()     # ValueError: cuda without CUDA
        resolved = config.for_device(device)
        check_config_fits(resolved, device)
    except ValueError as err:
        if isinstance(err, StartupRefused):
            raise
        raise StartupRefused(str(err)) from None
    return resolved


_FITTED: set[tuple] = set()       # what check_config_fits accepted in this process (the core checks once)


def check_config_fits(config: EngineConfig, device: str) -> None:
    from tokenforge.planning.fit import check_fit  # noqa: PLC0415 - reads the model's shape (torch)

    memory_fraction = config.cache.gpu_memory_utilization if device == "cuda" else 1.0
    args = (config.model.model, config.load.load_format, config.model.dtype, device, memory_fraction,
            config.parallel.world_size, int(config.load.cpu_offload_gb * 1e9))
    if args not in _FITTED:
        check_fit(*args)
        _FITTED.add(args)
