"""EngineConfig: one nested, validated, frozen configuration.

In: keyword arguments from the CLI or `LLM(...)`. Out: a frozen `EngineConfig` whose sub-configs
each component takes. Facts discovered at run time (the KV block count, EOS ids, the vocabulary)
live in `RuntimeInfo`, never mutated into the config.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from tokenforge.config.checks import (check as _check, parse_kv_remote, parse_size, validate_kv_tiers,
                                     validate_quantization, validate_speculative)
from tokenforge.config.lora import LORA, LoRAConfig
from tokenforge.source import resolve_hub_fields

__all__ = ["LORA", "LoRAConfig", "parse_kv_remote", "parse_size"]   # re-exported

QUANTIZATION_MODES = (None, "int8", "int4", "fp8", "fp8-sim")
QUANTIZATION_ALIASES = {"8bit": "int8", "4bit": "int4"}    # the playbook's spellings
DEFAULT_MAX_LOGPROBS = 20                                  # vLLM's default cap on logprobs per token
TIERS, PARALLEL, CACHE = "KV cache tiers (device -> CPU -> disk -> Redis, keyed by prefix hash)", "parallelism", "engine cache"


def flag(default, help: str, *aliases: str, **cli):
    """A field that is also the engine flag --<name> (cli/engine_args.py builds it, from_cli reads it back). cli:
    group, cli_default (the flag's default; None: the config decides), choices, values (spelling -> value) and invalid
    (the error), switches (flag -> value or (value, help)), serve, negate (--no-<name>), flag, metavar, type."""
    return field(default=default, metadata={"help": help, "aliases": aliases, **cli})


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str | None = flag(None, "GGUF file, HF directory, a Hugging Face Hub id (org/name; honours HF_TOKEN and "
                             "HF_HUB_OFFLINE=1), or a shipped config name (llama-3.1-8b, llama-3.1-70b, qwen2.5-7b, "
                             "llama-3.2-1b) with --load-format dummy; default: bundled SmolLM2")  # source.py
    revision: str | None = flag(None, "branch, tag or commit of a Hub model")
    tokenizer: str | None = flag(None, "the tokenizer in place of the model's own: an HF directory (tokenizer.json), "
                                 "a .gguf file or a Hub id (vLLM's --tokenizer); its ids must fit the model's "
                                 "vocabulary", metavar="PATH")
    dtype: str = flag("auto", "auto: bfloat16 on CUDA, float32 on the CPU, where a GGUF model computes its "
                      "quantized blocks as stored (8-bit activations); float32 there: the dequantized reference",
                      choices=("auto", "float32", "bfloat16", "float16"),
                      switches={"--fp16": "float16", "--half": "float16", "--bf16": "bfloat16"})
    max_model_len: int | None = flag(None, "context length (default: the model's)", "--max-seq-length")
    max_logprobs: int = flag(DEFAULT_MAX_LOGPROBS, "the most logprobs (and prompt_logprobs) a request may ask for, as vLLM's; "
                             "-1: the whole vocabulary", metavar="N")
    seed: int = flag(0, "the random seed: of the dummy weights, and in generate of sampling too (each prompt's "
                     "sample is reproducible; greedy needs none)")
    model_version: str | None = flag(
        None, "the version label of the weights (playbook MODEL_VERSION); shown by /v1/models and /metrics, and a "
        "router refuses to mix replicas of one model with different versions", serve=True, metavar="VERSION")
    model_checksum: str | None = flag(
        None, "refuse to serve unless the weights hash to this (sha256sum of the .gguf; see the README for HF "
        "directories); the computed checksum is shown by /v1/models", serve=True, metavar="SHA256")
    quantization: str | None = flag(
        None, "int8: weight-only per output channel (on the CPU: dynamic int8 linears, fbgemm); int4: weight-only, "
        "asymmetric groups (--quantization-group-size; on the CPU simulated by dequantizing); fp8: W8A8 e4m3 with "
        "per-token activation scales (Hopper GPUs); fp8-sim: fp8 numerics simulated in float (any device; quality "
        "checks). Playbook: 8bit, 4bit", values={m: m for m in QUANTIZATION_MODES if m} | QUANTIZATION_ALIASES,
        invalid="is not a quantization mode: int8 (alias 8bit), int4 (alias 4bit), fp8, fp8-sim")
    quantization_group_size: int = flag(128, "int4: inputs per scale (default 128)")
    quantize_lm_head: bool = flag(False, "quantize the lm_head too (int8, int4, fp8; a tied lm_head gets its own "
                                  "quantized copy and the embedding stays in the model dtype; default: model dtype)")
    quantization_calibration: str | None = flag(
        None, "int4 only: GPTQ rounding computed at load from this calibration text (a UTF-8 FILE, or 'builtin': "
        "~3,600 tokens of varied prose and code shipped with tokenforge); default: round-to-nearest",
        metavar="FILE|builtin")
    quantization_backend: str = flag("tokenforge", "tokenforge (the default and only backend; bitsandbytes is refused)")
    prune_rate: float | None = flag(None, "zero this fraction of each linear's weights by magnitude (quality only: weights stay dense)")
    sparsity: str | None = flag(None, "2:4: semi-structured pruning, run as sparse tensors on the GPU (dense on the CPU)")
    model_id: str | None = None         # the Hub id the user gave, when `model` is its local snapshot
    calibration_token_ids: tuple[int, ...] | None = None   # the calibration text, encoded (engine_core.py)

    def validate(self) -> None:
        validate_quantization(self, QUANTIZATION_MODES)
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"),
               f"dtype must be one of auto, float32, bfloat16, float16, got {self.dtype!r}")
        _check(self.max_model_len is None or self.max_model_len >= 1,
               f"max_model_len must be >= 1, got {self.max_model_len}")
        _check(self.max_logprobs >= -1, f"max_logprobs must be >= 0, or -1 for the vocabulary, got {self.max_logprobs}")
        _check(self.tokenizer is None or os.path.exists(os.path.expanduser(self.tokenizer)),
               f"tokenizer {self.tokenizer!r} does not exist (a directory with tokenizer.json, a .gguf file or a "
               "Hub id org/name)")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = flag(16, None, "--kv-cache-block-size")
    enable_prefix_caching: bool = flag(True, "turn the prefix cache off", negate=True)
    num_kv_blocks: int | None = flag(None, "KV blocks, overriding the memory sizing")
    kv_cache_memory: int | None = flag(None, "absolute KV budget, e.g. 8GiB", "--memory-limit", type="str")  # bytes
    gpu_memory_utilization: float = flag(0.9, "share of the device memory for weights, activations and the KV cache")
    memory_profile: str = flag("server", "server: profile, then fill the memory; client: max-num-seqs x "
                               "max-model-len only", choices=("server", "client"))
    kv_cache_dtype: str = flag("auto", "auto: the model's dtype; fp8 (alias fp8_e4m3): e4m3 with per-layer K/V "
                               "scales, half the bytes per token (GPUs with FP8: sm89+; the torch backend on the CPU)",
                               values={"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"},
                               invalid="is not a KV cache dtype: use auto or fp8 (e4m3, alias fp8_e4m3)")
    memory_fragmentation_threshold: float | None = flag(None, "release cached blocks between steps above this allocator fragmentation")
    pin_memory: bool = flag(True, "host buffers for copies", flag="--memory-policy", cli_default="pin",
                            values={"pin": True, "pageable": False}, metavar="{pin,pageable}",
                            invalid="is not a memory policy: use pin or pageable")
    # KV tiers below the device (see executor/tiers): sizes in GB (10**9 bytes), 0 = off.
    kv_offload_cpu_gb: float = flag(0.0, "host memory (pinned on CUDA) for KV blocks evicted from the device, LRU "
                                    "(default off)", group=TIERS, metavar="GB")
    kv_offload_disk_dir: str | None = flag(None, "local disk tier under the CPU tier", group=TIERS, metavar="DIR")
    kv_offload_disk_gb: float = flag(0.0, "size of the disk tier", group=TIERS, metavar="GB")
    kv_remote: str | None = flag(None, "shared tier: redis://host:port[/db], rediss://host:port or "
                                 "redis+cluster://h1:p1,h2:p2", group=TIERS, metavar="URL")
    kv_remote_ttl: int = flag(3600, "TTL of every remote key, so maxmemory-policy volatile-lru applies (default %(default)s)", group=TIERS, metavar="SECONDS")
    # None: on whenever kv_remote is set (False turns it off); cost measured by tests/executor/test_kv_remote_replicas.py
    kv_remote_write_through: bool | None = flag(
        None, "put a request's prefix blocks to the remote tier when it completes, so other replicas reuse them "
        "(default with --kv-remote; off: blocks go to Redis only when evicted). Cost: each prompt block is put once: "
        "2 x layers x KV heads x head dim x dtype bytes a token (bundled model float32 45 KiB, Llama-3.1-8B bf16 "
        "128 KiB) plus ~7%% Redis overhead a key; a 1,500-token prompt's 94 blocks (69 MB) landed 0.36 s after it "
        "ended (>= 190 MB/s)", group=TIERS)

    @property
    def kv_tiers_enabled(self) -> bool:
        return bool(self.kv_offload_cpu_gb or self.kv_offload_disk_dir or self.kv_remote)

    @property
    def remote_write_through(self) -> bool:
        return self.kv_remote is not None and self.kv_remote_write_through is not False

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


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = flag(256, "sequences per step (default: 512 on CUDA, 256 on the CPU); with --pipeline-steps "
                             "K, up to K steps of this many run at once", "--max-parallel-batch", "--batch-size",
                             "--micro-batch-size", "--micro_batch_size", cli_default=None)
    max_num_batched_tokens: int = flag(2048, "token budget per step; long prompts are chunked to fit (chunked "
                                       "prefill); default: 8192 on CUDA, 2048 on the CPU", cli_default=None)
    max_model_len: int = 2048               # resolved against the model by EngineConfig.create
    max_tokens_default: int | None = flag(None, "cap (and default) for max_tokens", "--max-inference-steps",
                                          flag="--max-tokens-limit")
    async_scheduling: bool | None = flag(None, "schedule step N+1 while step N runs on the device (default: on for CUDA)")
    pipeline_steps: int = flag(1, "with pipeline parallelism: steps (batches of distinct requests) in flight at "
                               "once, so every stage has work (default: the pipeline parallel size)",
                               "--pipeline_steps", cli_default=None, group=PARALLEL, metavar="N")
    speculative_method: str | None = flag(None, "speculative decoding: ngram (prompt lookup over the request's prompt and "
                                          "output; greedy output unchanged, sampling exact by rejection sampling)",
                                          choices=("ngram", "draft", "eagle"))
    num_speculative_tokens: int | None = flag(None, "drafts per request and step, 1-16 (default 4)", metavar="K")
    speculative_model: str | None = flag(None, "the draft model (draft: a smaller model with the target's tokenizer) or EAGLE / EAGLE-3 head directory (eagle)")
    ngram_min: int = flag(2, "shortest n-gram the ngram method matches", metavar="N")
    ngram_max: int = flag(4, "longest n-gram the ngram method matches", metavar="N")
    speculative_tree: bool = flag(False, "eagle: draft a tree of K nodes, batch 1 (max_num_seqs 1; requests with logprobs, "
                                  "penalties or min_tokens decode undrafted); triton attention (the GPU default) keeps chains")

    @property
    def num_draft_tokens(self) -> int:   # drafts (tree nodes) per request and step (0 without speculation)
        k = self.num_speculative_tokens
        return 0 if self.speculative_method is None else (4 if k is None else k)

    def validate(self) -> None:
        # None (the two batch limits): left for the engine core, which knows the device (for_device).
        _check(self.max_num_seqs is None or self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        validate_speculative(self)
        _check(isinstance(self.pipeline_steps, int) and self.pipeline_steps >= 1,
               f"pipeline_steps must be an integer >= 1, got {self.pipeline_steps!r}")
        _check(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
               f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.max_tokens_default is None or self.max_tokens_default >= 1,
               f"max_tokens_default must be >= 1, got {self.max_tokens_default}")


EXECUTOR_BACKENDS = ("auto", "uni", "mp", "torchrun")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = flag(1, "split every layer across N ranks (GPUs, or CPU processes with gloo)",
                                     "-tp", "--model_parallelism", "--model_parallelism_level",
                                     "--model-parallelism", "--shard-size", cli_default=None, group=PARALLEL)
    pipeline_parallel_size: int = flag(1, "split the layers into N contiguous stages, one rank (or TP group) each",
                                       "-pp", "--pipe_parallelism", "--pipe_parallelism_level", "--pipe-parallelism",
                                       cli_default=None, group=PARALLEL)
    enable_expert_parallel: bool = flag(False, "mixture-of-experts models: each tensor-parallel rank holds whole "
                                        "experts (E / N of them) instead of a slice of every expert",
                                        group=PARALLEL)
    # auto: one process without parallelism; torchrun when launched by it (WORLD_SIZE > 1); else mp.
    distributed_executor_backend: str = flag(
        "auto", "mp: one worker process per rank on this host (default with TP/PP); torchrun: ranks started by "
        "torchrun (auto-detected from WORLD_SIZE)", "--distributed_executor", "--distributed-executor",
        choices=("auto", "uni", "mp", "torchrun"), group=PARALLEL)

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
    load_format: str = flag("auto", "dummy: random weights of the model's shape (benchmarks); lazy: stream "
                            "memory-mapped weights (each rank reads its slices; on the CPU with an engine cache, "
                            "mapped, not copied)", choices=("auto", "gguf", "safetensors", "dummy", "lazy"),
                            switches={"--lazy-loading": "lazy", "--lazy_loading": "lazy"})
    engine_cache_dir: str | None = flag(None, "keep the Triton and compile caches here, so a restart skips the JIT",
                                        "--engine_cache_dir", group=CACHE)
    cpu_offload_gb: float = flag(0.0, "CUDA: keep N GB of weights (the last layers) in pinned host memory, each "
                                 "copied in one layer ahead on a side stream (runs without CUDA graphs)",
                                 group=CACHE, metavar="N")

    def validate(self) -> None:
        _check(self.load_format in ("auto", "gguf", "safetensors", "dummy", "lazy"),
               f"load_format must be one of auto, gguf, safetensors, dummy, lazy, got {self.load_format!r}")
        _check(self.cpu_offload_gb >= 0, f"cpu_offload_gb must be >= 0, got {self.cpu_offload_gb}")


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    device: str = flag("auto", "auto: cuda if there is one", choices=("auto", "cpu", "cuda"))
    attention_backend: str = flag("auto", "auto: triton on CUDA, torch on the CPU", choices=("auto", "torch", "triton"),
                                  switches={"--use-flash-attention": "triton", "--use_flash_attention": "triton"})
    enforce_eager: bool = flag(False, "disable CUDA graphs (on the CPU: the native GGUF decode step)", switches={"--cuda-graphs": (False, "CUDA graphs on (the default)")})
    num_threads: int | None = flag(None, "CPU threads")     # None = torch's default
    profile_dir: str | None = flag(None, "write torch.profiler traces here")

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
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def validate(self) -> EngineConfig:
        for sub in (self.model, self.cache, self.scheduler, self.parallel, self.load, self.device, self.lora):
            sub.validate()
        _check(not self.lora.enable_lora or self.parallel.world_size == 1,
               "enable_lora serves adapters on one rank only yet: not with tensor or pipeline parallelism")
        steps, pp = self.scheduler.pipeline_steps, self.parallel.pipeline_parallel_size
        _check(not self.model.quantization_calibration or pp == 1,
               "quantization_calibration runs the whole model on each rank to calibrate: not with "
               "pipeline_parallel_size > 1 yet (calibrate with `tokenforge quantize`, then serve its checkpoint)")
        _check(steps == 1 or pp > 1, f"pipeline_steps {steps} keeps several steps in flight across pipeline "
               "stages: it needs pipeline_parallel_size > 1 (or pipeline_steps 1)")
        return self

    @staticmethod
    def cli_kwargs(args) -> dict:
        """The one converter from the command line: the flat engine arguments (the `flag` fields, and
        model_id once a Hub id is resolved) that an argparse namespace holds. from_cli builds on it."""
        return {n: getattr(args, n) for n in [*(f.name for f in flag_fields()), "model_id"] if hasattr(args, n)}

    @staticmethod
    def from_cli(args) -> EngineConfig:
        return EngineConfig.from_kwargs(**EngineConfig.cli_kwargs(args))

    @staticmethod
    def from_kwargs(**kwargs) -> EngineConfig:
        """Flat keyword arguments (`LLM(...)`, the CLI) to sub-configs; unset batch limits: the device's defaults."""
        config = EngineConfig.unresolved(**kwargs)
        return config._with_batch_defaults(config.device.resolved_device()) if config.needs_device else config

    @property
    def needs_device(self) -> bool:
        """Whether the unset batch limits still wait for the device (an `unresolved` config)."""
        return self.scheduler.max_num_seqs is None or self.scheduler.max_num_batched_tokens is None

    def for_device(self, device: str) -> EngineConfig:   # a resolved device ('cpu' or 'cuda'), batch limits filled
        return dataclasses.replace(self._with_batch_defaults(device),
                                   device=dataclasses.replace(self.device, device=device))

    def _with_batch_defaults(self, device: str) -> EngineConfig:
        defaults = DEVICE_BATCH_DEFAULTS[device] | ({"max_num_seqs": 1} if self.scheduler.speculative_tree else {})
        filled = {k: v for k, v in defaults.items() if getattr(self.scheduler, k) is None}
        return dataclasses.replace(self, scheduler=dataclasses.replace(self.scheduler, **filled)).validate()

    @staticmethod
    def unresolved(**kwargs) -> EngineConfig:
        """As from_kwargs, but unset batch limits stay None and no device is probed: the engine core
        resolves them (`for_device`), so serve's API process never imports torch."""
        groups: dict[str, dict] = {name: {} for name in _SUBCONFIGS}
        # max_model_len is asked for once (ModelConfig); EngineCore resolves the scheduler's copy (with_max_model_len)
        owners = {f.name: name for name, cls in reversed(_SUBCONFIGS.items()) for f in dataclasses.fields(cls)}
        for key, value in kwargs.items():
            if key not in owners:
                raise TypeError(f"unknown engine argument {key!r}")
            groups[owners[key]][key] = value
        groups["scheduler"].update({k: None for k in DEVICE_BATCH_DEFAULTS["cpu"] if groups["scheduler"].get(k) is None})
        groups["parallel"] = {k: v for k, v in groups["parallel"].items() if v is not None}   # None: the default
        if groups["scheduler"].get("pipeline_steps") is None:     # one step per stage in flight
            groups["scheduler"]["pipeline_steps"] = groups["parallel"].get("pipeline_parallel_size") or 1
        quant = groups["model"].get("quantization")
        groups["model"]["quantization"] = QUANTIZATION_ALIASES.get(quant, quant)
        if "kv_cache_memory" in groups["cache"]:
            groups["cache"]["kv_cache_memory"] = parse_size(groups["cache"]["kv_cache_memory"])
        resolve_hub_fields(groups["model"])
        if groups["model"].get("max_model_len") is not None:
            groups["scheduler"]["max_model_len"] = groups["model"]["max_model_len"]
        return EngineConfig(**{name: _SUBCONFIGS[name](**vals) for name, vals in groups.items()}).validate()

    def with_max_model_len(self, max_model_len: int) -> EngineConfig:
        """The resolved context length, once the model's own limit is known."""
        return dataclasses.replace(self, model=dataclasses.replace(self.model, max_model_len=max_model_len),
                                   scheduler=dataclasses.replace(self.scheduler, max_model_len=max_model_len)).validate()


# Batch limits a user does not set depend on the device, as in vLLM: a GPU step is cheap per token only when
# it is wide (W2 on an H200: 14.6k tok/s at 256 x 2048, 16.0k at 512 x 8192); the CPU prefers smaller steps.
DEVICE_BATCH_DEFAULTS = {"cpu": {"max_num_seqs": 256, "max_num_batched_tokens": 2048},
                         "cuda": {"max_num_seqs": 512, "max_num_batched_tokens": 8192}}
_SUBCONFIGS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig,
               "load": LoadConfig, "device": DeviceConfig, "lora": LoRAConfig}


def flag_fields() -> list[dataclasses.Field]:
    """Every field that is an engine flag, in the order of the sub-configs."""
    return [f for cls in _SUBCONFIGS.values() for f in dataclasses.fields(cls) if "help" in f.metadata]


def encode_config(config: EngineConfig) -> bytes:
    """The config as msgpack (maps of its sub-configs): it crosses to child processes (core, workers) unpickled."""
    import msgspec  # noqa: PLC0415

    return msgspec.msgpack.encode(dataclasses.asdict(config))


def decode_config(data: bytes) -> EngineConfig:
    # Rebuilt field by field rather than type-checked: it was validated in the parent already.
    import msgspec  # noqa: PLC0415

    return EngineConfig(**{name: _SUBCONFIGS[name](**values) for name, values in msgspec.msgpack.decode(data).items()})


@dataclass(frozen=True, slots=True)
class RuntimeInfo:
    """Facts known only once the model is loaded and the KV cache sized."""
    num_kv_blocks: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    max_logprobs: int = DEFAULT_MAX_LOGPROBS    # the config's, the vocabulary for -1

    @staticmethod
    def logprobs_limit(max_logprobs: int, vocab_size: int) -> int:
        return vocab_size if max_logprobs == -1 else max_logprobs
