"""Every message that crosses a boundary: frontend <-> engine core, and engine -> user.

Engine-core messages are msgspec structs, so they travel as msgpack over ZMQ (never pickle).
User-facing outputs (`RequestOutput`, `CompletionOutput`, `Logprob`) mirror vLLM's names.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec


class FinishReason(str, enum.Enum):
    STOP = "stop"          # EOS, a stop token id or a stop string
    LENGTH = "length"      # max_tokens or max_model_len
    ABORT = "abort"        # client went away or the server aborted it

    def __str__(self) -> str:
        return self.value


class WireSamplingParams(msgspec.Struct, frozen=True):
    """SamplingParams as they travel to the engine core (the core needs no stop strings)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: str | None = None          # a compiled llguidance grammar (its text is its identity)
    grammar_after: tuple[int, ...] = ()  # the grammar starts once these ids appear in the output
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias) pairs, ids ascending

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        """Repetition, presence or frequency penalty: sampling reads the request's own output."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def shapes_logits(self) -> bool:
        """A penalty or a logit bias changes the logits before sampling: the raw argmax is not the token."""
        return self.has_penalties or bool(self.logit_bias)


class LoRARequest(msgspec.Struct, frozen=True):
    """A LoRA adapter a request runs with, as vLLM's `LoRARequest(name, id, path)`: a PEFT
    directory (adapter_config.json + adapter_model.safetensors), its name, and a positive id."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


class EngineCoreRequest(msgspec.Struct, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    params: WireSamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    arrival_time: float = 0.0
    lora: LoRARequest | None = None
    lora_key: str | None = None          # the adapter's content fingerprint, set by the engine core


class PositionLogprobs(msgspec.Struct, frozen=True):
    """Logprobs at one position: the chosen token first, then the top-N (which may repeat it)."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]           # 1-based rank of each token in the distribution


class EngineCoreOutput(msgspec.Struct, frozen=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None   # first prompt token has none
    finish_reason: str | None = None     # a FinishReason value
    stop_token_id: int | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class KVTierStats(msgspec.Struct):
    """Cumulative counters of the KV tiers (cpu, disk, remote) since the engine started."""

    hits: dict[str, int] = msgspec.field(default_factory=dict)            # blocks, by tier
    misses: dict[str, int] = msgspec.field(default_factory=dict)
    bytes_restored: dict[str, int] = msgspec.field(default_factory=dict)
    puts: dict[str, int] = msgspec.field(default_factory=dict)            # blocks written, by tier
    dropped_puts: dict[str, int] = msgspec.field(default_factory=dict)    # by reason: backpressure, remote_down
    errors: dict[str, int] = msgspec.field(default_factory=dict)          # by cause: timeout, checksum, disk_full...
    restore_bounds: list[float] = msgspec.field(default_factory=list)     # histogram upper bounds (seconds)
    restore_counts: list[int] = msgspec.field(default_factory=list)       # per bound, not cumulative; last is +Inf
    restore_sum: float = 0.0                                              # seconds, lookup to blocks in place
    restore_copy_sum: float = 0.0                                         # of which copying into the device cache
    restored_tokens: int = 0
    remote_up: bool | None = None                                         # None: no remote tier


class SpecDecodeStats(msgspec.Struct):
    """Speculative decoding totals since start-up (vLLM's spec_decode counters)."""

    num_drafts: int = 0                   # sequences verified with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = msgspec.field(default_factory=list)   # [K]: drafts accepted at position i


class EngineStats(msgspec.Struct):
    """A snapshot the server exports as Prometheus metrics."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0                 # used blocks / total blocks
    kv_fragmentation: float = 0.0         # unused slots in partly filled blocks / allocated slots
    prefix_cache_queries: int = 0         # tokens looked up (cumulative)
    prefix_cache_hits: int = 0            # tokens found (cumulative)
    num_preemptions: int = 0              # cumulative
    num_kv_blocks: int = 0
    num_free_blocks: int = 0
    allocator_fragmentation: float = 0.0  # device allocator: reserved-but-unallocated / reserved
    lora_swaps: int = 0                   # adapters written into a device slot (cumulative)
    kv_tiers: KVTierStats | None = None   # None when no KV tier is configured
    spec_decode: SpecDecodeStats | None = None   # None without speculative decoding
    jit_compiles_after_ready: int = 0     # kernels compiled after start-up (executor/compile_watch.py)
    cuda_graphs_pending: int = 0          # decode buckets whose graph is still to be captured (while idle)
    eager_decode_steps: int = 0           # decode steps run without a graph, their bucket not captured yet


# ---- engine core (rank 0) -> workers (ranks 1..N-1), once per step ------------------------------

class WorkerSequence(msgspec.Struct, array_like=True):
    """What a non-driver rank needs of a scheduled sequence: the tokens and where their KV goes.
    Sampling happens on rank 0 only, so penalties' token lists and sampling params stay there."""

    request_id: str
    token_ids: list[int]             # the last may be a placeholder (PLACEHOLDER_TOKEN_ID)
    start_position: int
    block_table: list[int]
    sample: bool
    prompt_logprob_rows: int = 0     # rows of this chunk whose logits rank 0 computes (a TP collective)
    num_draft_tokens: int = 0        # speculative decoding: drafts at the end of token_ids (their logits too)


class WorkerStep(msgspec.Struct, tag="step", array_like=True):
    sequences: list[WorkerSequence]
    finished_request_ids: list[str]

    @property
    def is_empty(self) -> bool:
        return not self.sequences

    @property
    def lora_loads(self) -> list:
        """LoRA slot writes: none on a worker (LoRA is refused across processes; the runner reads
        this field of a SchedulerOutput and a WorkerStep alike)."""
        return []


class WorkerFinishStep(msgspec.Struct, tag="finish", array_like=True):
    """Pipelined steps with TP: the first stage's ranks finish their oldest step in flight (take the
    last stage's hidden states, run the LM head's collectives, take the sampled ids), as rank 0
    does when it collects that step. The other stages have nothing to finish and skip it."""


class WorkerInitKVCache(msgspec.Struct, tag="init_kv", array_like=True):
    """Profile memory (a forward pass every rank runs in step), agree on the block count, allocate."""

    max_model_len: int               # resolved against the model by the engine core


class WorkerProfile(msgspec.Struct, tag="profile", array_like=True):
    start: bool


class WorkerShutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


WorkerMessage = WorkerStep | WorkerFinishStep | WorkerInitKVCache | WorkerProfile | WorkerShutdown


# ---- user-facing outputs (vLLM-shaped) ----------------------------------------------------------

@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
