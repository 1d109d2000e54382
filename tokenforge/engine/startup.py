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


# ---- the one-line start-up timeline of `serve` ------------------------------------------------------

def startup_timeline(api: dict[str, float], core: dict[str, float], phases: dict[str, float]) -> str:
    """Both processes' start-up on one clock, in seconds from the API process's start: what ran
    in parallel and what was serial. `api`, `core`: wall-clock marks (core_boot.MARKS in the API
    process, Ready.marks from the core); `phases`: the core's durations (EngineCore.startup_phases)."""
    origin = api.get("api_exec") or min([*api.values(), *core.values()], default=0.0)

    def at(name: str, marks: dict[str, float]) -> str | None:
        return f"{marks[name] - origin:.2f}" if name in marks else None

    def span(label: str, begin: str, end: str, marks: dict[str, float]) -> str | None:
        a, b = at(begin, marks), at(end, marks)
        return f"{label} {a}-{b}" if a is not None and b is not None else None

    def point(label: str, name: str, marks: dict[str, float]) -> str | None:
        value = at(name, marks)
        return f"{label} {value}" if value is not None else None

    api_parts = [span("imports", "api_exec", "api_parsed", api), point("config sent", "config_sent", api),
                 span("server imports", "config_sent", "server_imported", api),
                 span("tokenizer", "tokenizer_start", "tokenizer_end", api), point("ready", "ready_received", api),
                 span("app", "ready_received", "app_built", api), point("listening", "listening", api)]
    torch_end = "torch" if "torch" in core else "core_boot"
    core_parts = [point("spawned", "core_spawned", api), span("python", "core_exec", "core_boot", core),
                  span("torch", "core_boot", "torch", core), span("engine code", torch_end, "engine_code", core),
                  span("cuda", "cuda_start", "cuda_end", core), point("config", "config", core),
                  span("resolve", "resolve_start", "resolve_end", core),
                  span("load", "engine_start", "loaded", core), span("kv_cache", "loaded", "kv_ready", core)]
    inner = [f"{name} {phases[name]:.2f} s" for name in ("cuda_graphs", "warm_up") if phases.get(name)]
    if inner and core_parts[-1] is not None:
        core_parts[-1] += f" ({', '.join(inner)})"
    core_parts.append(point("ready", "ready", core))
    end = api.get("listening", api.get("ready_received"))
    head = f"start-up timeline: {end - origin:.2f} s to listening" if end is not None else "start-up timeline"
    return (f"{head} (s from process start) | api: {', '.join(p for p in api_parts if p)} | "
            f"core: {', '.join(p for p in core_parts if p)}")
