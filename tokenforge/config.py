"""EngineConfig: one nested, validated, frozen configuration.

In: keyword arguments from the CLI or `LLM(...)`. Out: a frozen `EngineConfig` whose sub-configs
each component takes. Facts discovered at run time (the KV block count, EOS ids, the vocabulary)
live in `RuntimeInfo`, never mutated into the config.
"""

from __future__ import annotations

import dataclasses
import os
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


QUANTIZATION_MODES = (None, "int8", "int4", "fp8", "fp8-sim")
QUANTIZATION_ALIASES = {"8bit": "int8", "4bit": "int4"}    # the playbook's spellings


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str | None = None            # a GGUF file, an HF directory, or a config.json (dummy); None = bundled
    dtype: str = "auto"                 # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None    # None = the model's max_position_embeddings
    seed: int = 0
    model_version: str | None = None    # the operator's label for the weights; shown by /v1/models, /metrics
    model_checksum: str | None = None   # sha256 the weights must hash to (engine/model_identity.py), or refuse
    quantization: str | None = None     # None | int8 | int4 | fp8 | fp8-sim (aliases 8bit, 4bit)
    quantization_group_size: int = 128  # int4 inputs per scale / zero point
    quantize_lm_head: bool = False
    quantization_backend: str = "tokenforge"
    prune_rate: float | None = None     # unstructured magnitude pruning per linear (quality only)
    sparsity: str | None = None         # None | 2:4
    revision: str | None = None         # a Hub model's branch, tag or commit
    model_id: str | None = None         # the Hub id the user gave, when `model` is its local snapshot

    def validate(self) -> None:
        self._validate_quantization()
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"),
               f"dtype must be one of auto, float32, bfloat16, float16, got {self.dtype!r}")
        _check(self.max_model_len is None or self.max_model_len >= 1,
               f"max_model_len must be >= 1, got {self.max_model_len}")

    def _validate_quantization(self) -> None:
        _check(self.quantization in QUANTIZATION_MODES,
               f"quantization must be one of {', '.join(m for m in QUANTIZATION_MODES if m)} (aliases 8bit, 4bit) "
               f"or unset, got {self.quantization!r}")
        if self.quantization_backend == "bitsandbytes":
            equivalent = {"int4": "int4 (bitsandbytes 4-bit)", "int8": "int8 (bitsandbytes LLM.int8)"}
            raise ValueError("quantization_backend 'bitsandbytes' is not supported: tokenforge quantizes with its own "
                             "kernels (quantization_backend='tokenforge'); use quantization="
                             + equivalent.get(self.quantization or "", "int8 (for 8-bit) or int4 (for 4-bit)"))
        _check(self.quantization_backend == "tokenforge",
               f"quantization_backend must be tokenforge, got {self.quantization_backend!r}")
        g = self.quantization_group_size
        _check(g >= 8 and g % 8 == 0, f"quantization_group_size must be a positive multiple of 8, got {g}")
        _check(not self.quantize_lm_head or self.quantization in ("int8", "int4", "fp8", "fp8-sim"),
               "quantize_lm_head needs a quantization mode")
        _check(self.prune_rate is None or 0.0 <= self.prune_rate < 1.0,
               f"prune_rate must be in [0, 1), got {self.prune_rate}")
        _check(self.sparsity in (None, "2:4"),
               f"sparsity {self.sparsity!r} is not supported: only 2:4 semi-structured sparsity (what sparse "
               "tensor cores run)")
        _check(not (self.sparsity and self.quantization),
               f"sparsity 2:4 cannot be combined with quantization={self.quantization!r}: pick one")


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
    # KV tiers below the device (see executor/tiers): sizes in GB (10**9 bytes), 0 = off.
    kv_offload_cpu_gb: float = 0.0
    kv_offload_disk_dir: str | None = None
    kv_offload_disk_gb: float = 0.0
    kv_remote: str | None = None            # redis://h:p[/db], rediss://..., redis+cluster://h1:p1,h2:p2
    kv_remote_ttl: int = 3600               # seconds; every key gets one, so volatile-lru applies
    kv_remote_write_through: bool = False   # also put a request's blocks when it completes

    @property
    def kv_tiers_enabled(self) -> bool:
        return bool(self.kv_offload_cpu_gb or self.kv_offload_disk_dir or self.kv_remote)

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
        validate_kv_tiers(self)


def parse_kv_remote(url: str) -> tuple[str, list[tuple[str, int]], int]:
    """'redis://h:p/db', 'rediss://h:p' or 'redis+cluster://h1:p1,h2:p2' -> (scheme, nodes, db)."""
    m = re.fullmatch(r"(redis|rediss|redis\+cluster)://(?:[^@/]*@)?([^/?#]+)(?:/(\d*))?", url or "")
    if not m:
        raise ValueError(f"kv_remote {url!r} is not a Redis URL: use redis://host:port[/db], rediss://host:port "
                         "or redis+cluster://host1:port1,host2:port2")
    nodes = []
    for node in m.group(2).split(","):
        host, sep, port = node.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"kv_remote {url!r}: {node!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    if m.group(1) != "redis+cluster" and len(nodes) != 1:
        raise ValueError(f"kv_remote {url!r}: several nodes need the redis+cluster:// scheme")
    return m.group(1), nodes, int(m.group(3) or 0)


def validate_kv_tiers(c: CacheConfig) -> None:
    for name in ("kv_offload_cpu_gb", "kv_offload_disk_gb"):
        _check(getattr(c, name) >= 0, f"{name} must be >= 0, got {getattr(c, name)}")
    _check(c.kv_remote_ttl >= 1, f"kv_remote_ttl must be >= 1 second, got {c.kv_remote_ttl}")
    if c.kv_remote is not None:
        parse_kv_remote(c.kv_remote)
    _check(not c.kv_remote_write_through or c.kv_remote is not None,
           "kv_remote_write_through needs a remote tier (kv_remote=redis://...)")
    _check(not c.kv_tiers_enabled or c.enable_prefix_caching,
           "the KV offload tiers are keyed by prefix-cache hashes: they need prefix caching on")
    if c.kv_offload_disk_dir is None:
        _check(not c.kv_offload_disk_gb, "kv_offload_disk_gb needs kv_offload_disk_dir")
        return
    _check(c.kv_offload_disk_gb > 0, "kv_offload_disk_dir needs a size: kv_offload_disk_gb > 0")
    d = c.kv_offload_disk_dir
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise ValueError(f"kv_offload_disk_dir {d!r} cannot be created: {e.strerror}") from None
    _check(os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK), f"kv_offload_disk_dir {d!r} is not a writable directory")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048               # resolved against the model by EngineConfig.create
    max_tokens_default: int | None = None   # default max_tokens cap (playbook: --max-inference-steps)
    async_scheduling: bool | None = None    # schedule step N+1 while step N runs; None: on for CUDA
    # Pipeline parallelism: steps in flight at once, each over its own requests, so every stage
    # has work (playbook: --pipeline-steps). From kwargs, None: pipeline_parallel_size.
    pipeline_steps: int = 1
    # Speculative decoding (executor/spec/): a proposer drafts up to num_speculative_tokens per
    # request and step, one forward verifies them. ngram: prompt lookup over prompt + output.
    speculative_method: str | None = None
    num_speculative_tokens: int | None = None   # None: 4 when a method is set
    speculative_model: str | None = None        # the draft model or EAGLE head (draft | eagle)
    ngram_min: int = 2
    ngram_max: int = 4

    @property
    def num_draft_tokens(self) -> int:
        """Drafts per request and step (0 without speculative decoding)."""
        if self.speculative_method is None:
            return 0
        return 4 if self.num_speculative_tokens is None else self.num_speculative_tokens

    def validate(self) -> None:
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _validate_speculative(self)
        _check(isinstance(self.pipeline_steps, int) and self.pipeline_steps >= 1,
               f"pipeline_steps must be an integer >= 1, got {self.pipeline_steps!r}")
        _check(self.max_num_batched_tokens >= 1,
               f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.max_tokens_default is None or self.max_tokens_default >= 1,
               f"max_tokens_default must be >= 1, got {self.max_tokens_default}")


SPECULATIVE_METHODS = ("ngram", "draft", "eagle")
SPECULATIVE_METHODS_BUILT = ("ngram",)


def _validate_speculative(c: SchedulerConfig) -> None:
    m = c.speculative_method
    if m is None:
        _check(c.num_speculative_tokens is None and c.speculative_model is None,
               "num_speculative_tokens and speculative_model need speculative_method (ngram)")
        return
    _check(m in SPECULATIVE_METHODS,
           f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, got {m!r}")
    _check(m in SPECULATIVE_METHODS_BUILT,
           f"speculative_method={m!r} is not implemented yet; available: {', '.join(SPECULATIVE_METHODS_BUILT)}")
    k = c.num_draft_tokens
    _check(isinstance(k, int) and 1 <= k <= 16, f"num_speculative_tokens must be between 1 and 16, got {k!r}")
    if m == "ngram":
        _check(c.speculative_model is None,
               "speculative_model is for the draft and eagle methods: ngram looks drafts up in the request itself")
        _check(1 <= c.ngram_min <= c.ngram_max,
               f"need 1 <= ngram_min <= ngram_max, got {c.ngram_min} and {c.ngram_max}")
    _check(c.pipeline_steps == 1, "speculative decoding does not combine with pipeline_steps > 1 yet")


EXECUTOR_BACKENDS = ("auto", "uni", "mp", "torchrun")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # auto: one process without parallelism; `torchrun` when launched by it (WORLD_SIZE > 1 in the
    # environment); else `mp`, one worker process per rank on this host.
    distributed_executor_backend: str = "auto"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def validate(self) -> None:
        _check(self.tensor_parallel_size >= 1 and self.pipeline_parallel_size >= 1,
               "tensor_parallel_size and pipeline_parallel_size must be >= 1")
        _check(self.distributed_executor_backend in EXECUTOR_BACKENDS,
               f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
               f"got {self.distributed_executor_backend!r}")
        _check(self.distributed_executor_backend != "uni" or self.world_size == 1,
               "distributed_executor_backend 'uni' runs one process: it cannot serve "
               f"tensor_parallel_size x pipeline_parallel_size = {self.world_size}")


@dataclass(frozen=True, slots=True)
class LoadConfig:
    load_format: str = "auto"       # auto | gguf | safetensors | dummy | lazy
    engine_cache_dir: str | None = None
    cpu_offload_gb: float = 0.0     # CUDA: weights of the last layers kept in pinned host memory

    def validate(self) -> None:
        _check(self.load_format in ("auto", "gguf", "safetensors", "dummy", "lazy"),
               f"load_format must be one of auto, gguf, safetensors, dummy, lazy, got {self.load_format!r}")
        _check(self.cpu_offload_gb >= 0, f"cpu_offload_gb must be >= 0, got {self.cpu_offload_gb}")


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
        steps, pp = self.scheduler.pipeline_steps, self.parallel.pipeline_parallel_size
        _check(steps == 1 or pp > 1, f"pipeline_steps {steps} keeps several steps in flight across pipeline "
               "stages: it needs pipeline_parallel_size > 1 (or pipeline_steps 1)")
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
        if groups["scheduler"].get("pipeline_steps") is None:     # one step per stage in flight
            groups["scheduler"]["pipeline_steps"] = groups["parallel"].get("pipeline_parallel_size") or 1
        quant = groups["model"].get("quantization")
        groups["model"]["quantization"] = QUANTIZATION_ALIASES.get(quant, quant)
        if "kv_cache_memory" in groups["cache"]:
            groups["cache"]["kv_cache_memory"] = parse_size(groups["cache"]["kv_cache_memory"])
        _resolve_hub_model(groups["model"])
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


def _resolve_hub_model(model: dict) -> None:
    """A Hub id (org/name, not a local path) becomes its local snapshot, once, here: every later
    reader (loader, tokenizer, workers) sees a folder, and a missing model fails before anything
    is allocated."""
    ref = model.get("model")
    if not isinstance(ref, str) or model.get("model_id"):
        return
    from tokenforge.hub import looks_like_repo_id, resolve_hub_model  # noqa: PLC0415

    if looks_like_repo_id(ref):
        model["model_id"] = ref
        model["model"] = resolve_hub_model(ref, model.get("revision"))


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


def encode_config(config: EngineConfig) -> bytes:
    """The config as msgpack (plain maps of its sub-configs): it crosses to child processes (the
    engine core, the workers) unpickled."""
    import msgspec  # noqa: PLC0415

    return msgspec.msgpack.encode(dataclasses.asdict(config))


def decode_config(data: bytes) -> EngineConfig:
    # Rebuilt field by field rather than type-checked: it was validated in the parent already.
    import msgspec  # noqa: PLC0415

    groups = msgspec.msgpack.decode(data)
    return EngineConfig(**{name: type(getattr(EngineConfig(), name))(**values) for name, values in groups.items()})


@dataclass(frozen=True, slots=True)
class RuntimeInfo:
    """Facts known only once the model is loaded and the KV cache sized."""

    num_kv_blocks: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
