"""A request's mutable state inside the engine core.

In: a `messages.EngineCoreRequest`. Out: nothing by itself; the scheduler reads and advances it.
`all_token_ids` is one list that grows by appending, so a step never re-concatenates prompt and
output; `prompt_token_ids` and `output_token_ids` are handed to the runner by reference.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokenforge.core.hashing import BlockHash, adapter_root
from tokenforge.messages import EngineCoreRequest, FinishReason, LoRARequest, WireSamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


def check_prompt_fits(req: EngineCoreRequest, max_len: int, block_size: int, num_kv_blocks: int) -> None:
    """ValueError unless the prompt is non-empty and fits max_model_len and the whole KV cache."""
    n = len(req.prompt_token_ids)
    if n == 0:
        raise ValueError(f"request {req.request_id!r}: the prompt is empty")
    if n > max_len:
        raise ValueError(f"request {req.request_id!r}: the prompt has {n} tokens, more than max_model_len={max_len}")
    need = -(-n // block_size)
    if need > num_kv_blocks:
        raise ValueError(
            f"request {req.request_id!r}: the prompt of {n} tokens needs {need} KV blocks of {block_size} tokens, "
            f"but the KV cache has only {num_kv_blocks} blocks ({num_kv_blocks * block_size} tokens)")


@dataclass(slots=True, eq=False)     # eq=False: identity semantics, so deque.remove is exact
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: WireSamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    arrival_time: float = 0.0
    lora: LoRARequest | None = None
    lora_key: str | None = None                         # the adapter's fingerprint (None: the base model)

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)       # prompt + output, appended in place
    num_computed_tokens: int = 0                        # tokens whose KV is in (or queued for) the cache
    num_output_placeholders: int = 0                    # sampled on the device, not yet known here
    needs_sync: bool = False                            # penalties or prompt logprobs: see Scheduler
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[BlockHash] = field(default_factory=list)   # of full blocks, grown lazily
    num_cached_tokens: int = 0                          # prefix-cache hit at the first schedule
    num_prompt_logprobs_emitted: int = 1                # prompt positions covered (0 never has any)
    num_preemptions: int = 0
    tier_looked_up: bool = False                        # KV tiers asked since it last held no blocks
    num_tier_hit_tokens: int = 0                        # of num_computed_tokens, restored from a tier
    stop_token_id: int | None = None                    # the stop_token_ids member that ended it
    lora_slot: int = -1                                 # its adapter's device slot while running
    arrival_seq: int = 0                                # requests the scheduler received before it
    hash_root: BlockHash | None = field(init=False)     # the first block's parent: the adapter's root

    # Wall-clock times (time.time()) for metrics; None until the event happens.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.all_token_ids.extend(self.output_token_ids)
        self.hash_root = adapter_root(self.lora_key)

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> Request:
        return cls(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                   params=req.params, eos_token_ids=tuple(req.eos_token_ids),
                   cache_salt=req.cache_salt, arrival_time=req.arrival_time, lora=req.lora, lora_key=req.lora_key)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
