"""EngineConfig: one nested, validated, frozen configuration.

In: keyword arguments from the CLI or `LLM(...)`. Out: a frozen `EngineConfig` whose sub-configs
each component takes. Facts discovered at run time (the KV block count, EOS ids, the vocabulary)
live in `RuntimeInfo`, never mutated into the config.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_size(value: str | int | float | None) -> int | None:
    """Parse '8GiB', '8GB', '512MiB' or a plain byte count into bytes."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot parse size {value!r}: use a byte count or a unit such as 8GiB, 512MiB, 8GB")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str | None = None            # a GGUF file, an HF directory, or a config.json (dummy); None = bundled
    dtype: str = "auto"                 # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None    # None = the model's max_position_embeddings
    seed: int = 0
    model_version: str | None = None    # checked against the loaded model's checksum when given
    quantization: str | None = None     # None | int8 (dynamic int8 linears; CPU)

    def validate(self) -> None:
        _check(self.quantization in (None, "int8"),
               f"quantization must be int8 (or unset), got {self.quantization!r}; int4 and fp8 are not implemented yet")
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"),
               f"dtype must be one of auto, float32, bfloat16, float16, got {self.dtype!r}")
        _check(self.max_model_len is None or self.max_model_len >= 1,
               f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None        # overrides the sizing below
    kv_cache_memory: int | None = None      # bytes; absolute KV budget
    gpu_memory_utilization: float = 0.9
    memory_profile: str = "server"          # server: profile then fill; client: max_num_seqs x max_model_len
    kv_cache_dtype: str = "auto"            # auto (the model's dtype) | fp8 (e4m3, per-layer scales)
    memory_fragmentation_threshold: float | None = None
    pin_memory: bool = True

    def validate(self) -> None:
        _check(1 <= self.block_size <= 1024, f"block_size must be in [1, 1024], got {self.block_size}")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
               f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        _check(self.kv_cache_memory is None or self.kv_cache_memory > 0,
               f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        _check(0.0 < self.gpu_memory_utilization <= 1.0,
               f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(self.memory_profile in ("server", "client"),
               f"memory_profile must be server or client, got {self.memory_profile!r}")
        _check(self.kv_cache_dtype in ("auto", "fp8", "fp8_e4m3"),
               f"kv_cache_dtype must be 'auto' (the model's dtype) or 'fp8' (e4m3, alias fp8_e4m3), "
               f"got {self.kv_cache_dtype!r}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048               # resolved against the model by EngineConfig.create
    max_tokens_default: int | None = None   # default max_tokens cap (playbook: --max-inference-steps)
    async_scheduling: bool | None = None    # schedule step N+1 while step N runs; None: on for CUDA

    def validate(self) -> None:
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(self.max_num_batched_tokens >= 1,
               f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.max_tokens_default is None or self.max_tokens_default >= 1,
               f"max_tokens_default must be >= 1, got {self.max_tokens_default}")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def validate(self) -> None:
        _check(self.tensor_parallel_size >= 1 and self.pipeline_parallel_size >= 1,
               "tensor_parallel_size and pipeline_parallel_size must be >= 1")


@dataclass(frozen=True, slots=True)
class LoadConfig:
    load_format: str = "auto"       # auto | gguf | safetensors | dummy
    engine_cache_dir: str | None = None

    def validate(self) -> None:
        _check(self.load_format in ("auto", "gguf", "safetensors", "dummy"),
               f"load_format must be one of auto, gguf, safetensors, dummy, got {self.load_format!r}")


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    device: str = "auto"                # auto | cpu | cuda
    attention_backend: str = "auto"     # auto | torch | triton
    enforce_eager: bool = False         # no CUDA graphs
    num_threads: int | None = None      # CPU threads; None = torch's default
    profile_dir: str | None = None

    def validate(self) -> None:
        _check(self.device in ("auto", "cpu", "cuda"), f"device must be auto, cpu or cuda, got {self.device!r}")
        _check(self.attention_backend in ("auto", "torch", "triton"),
               f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")

    def resolved_device(self) -> str:
        """auto -> cuda or cpu; ValueError for cuda where there is none (before anything loads)."""
        if self.device == "cpu":
            return "cpu"
        try:
            import torch  # noqa: PLC0415 - config itself stays torch-free unless asked
            has_cuda = torch.cuda.is_available()
        except ImportError:
            has_cuda, torch = False, None
        if self.device == "cuda" and not has_cuda:
            build = f"torch {torch.__version__}" if torch is not None else "torch is not installed and"
            reason = "has no CUDA support" if torch is not None and torch.version.cuda is None else "sees no CUDA GPU"
            raise ValueError(f"device 'cuda' is not available: {build} {reason}; use --device cpu (or auto)")
        return "cuda" if has_cuda else "cpu"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)

    def validate(self) -> EngineConfig:
        for sub in (self.model, self.cache, self.scheduler, self.parallel, self.load, self.device):
            sub.validate()
        return self

    @staticmethod
    def from_kwargs(**kwargs) -> EngineConfig:
        """Route flat keyword arguments (as `LLM(...)` and the CLI take them) to the sub-configs."""
        groups: dict[str, dict] = {name: {} for name in ("model", "cache", "scheduler", "parallel", "load", "device")}
        owners = {f.name: name for name, cls in reversed(_SUBCONFIGS.items()) for f in dataclasses.fields(cls)}
        # max_model_len is asked for once (ModelConfig); the scheduler's copy is the resolved value
        # that EngineCore fills in with with_max_model_len() once the model's limit is known.
        for key, value in kwargs.items():
            if key not in owners:
                raise TypeError(f"unknown engine argument {key!r}")
            groups[owners[key]][key] = value
        _fill_device_defaults(groups)
        if "kv_cache_memory" in groups["cache"]:
            groups["cache"]["kv_cache_memory"] = parse_size(groups["cache"]["kv_cache_memory"])
        if groups["model"].get("max_model_len") is not None:
            groups["scheduler"]["max_model_len"] = groups["model"]["max_model_len"]
        return EngineConfig(**{name: _SUBCONFIGS[name](**vals) for name, vals in groups.items()}).validate()

    def with_max_model_len(self, max_model_len: int) -> EngineConfig:
        """The resolved context length, once the model's own limit is known."""
        return dataclasses.replace(
            self,
            model=dataclasses.replace(self.model, max_model_len=max_model_len),
            scheduler=dataclasses.replace(self.scheduler, max_model_len=max_model_len),
        ).validate()


# Batch limits a user does not set depend on the device, as in vLLM: a GPU step is cheap per
# token only when it is wide (W2 on an H200: 14.6k output tok/s at 256 sequences and 2048-token
# steps, 16.0k at 512 and 8192), while the CPU is at its best with smaller steps.
DEVICE_BATCH_DEFAULTS = {"cpu": {"max_num_seqs": 256, "max_num_batched_tokens": 2048},
                         "cuda": {"max_num_seqs": 512, "max_num_batched_tokens": 8192}}


def _fill_device_defaults(groups: dict[str, dict]) -> None:
    sched = groups["scheduler"]
    missing = [k for k in ("max_num_seqs", "max_num_batched_tokens") if sched.get(k) is None]
    if not missing:
        return
    device = DeviceConfig(**groups["device"]).resolved_device()
    for key in missing:
        sched[key] = DEVICE_BATCH_DEFAULTS.get(device, DEVICE_BATCH_DEFAULTS["cpu"])[key]


_SUBCONFIGS = {
    "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
    "parallel": ParallelConfig, "load": LoadConfig, "device": DeviceConfig,
}


@dataclass(frozen=True, slots=True)
class RuntimeInfo:
    """Facts known only once the model is loaded and the KV cache sized."""

    num_kv_blocks: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
