"""Plain data that flows between the scheduler and the executor, once per step.

Scheduler -> executor: `SchedulerOutput` (which tokens of which request to compute, where their
KV goes, and who samples). Executor -> scheduler: `ModelRunnerOutput` (sampled token ids and
logprobs as Python lists; never tensors). A request that samples gets a list of new tokens per
step: zero, one or several (one today; speculative decoding returns several), each with its
logprobs. The scheduler takes them one by one and stops at the first that ends the request (a stop
token, max_tokens, the length cap): the tokens after it are dropped. A step scheduled ahead (async
scheduling) reads the first token of the step before as its placeholder, so several tokens per
step need synchronous steps until a proposer plans for the placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenforge.messages import PositionLogprobs, WireSamplingParams

# A token id the host does not know yet: the previous step sampled it and it is still on the
# device. Only the last token of a scheduled sequence can be one; the runner fills it in on the
# device from the previous step's sampled ids (async scheduling). Pipelined steps (pipeline
# parallelism, several steps in flight) never carry one: a request is in one step in flight at most.
PLACEHOLDER_TOKEN_ID = -1
# A draft slot the runner's draft model fills in on the device before the verify forward
# (speculative_method 'draft'); a drafted sequence's last num_draft_tokens ids are then these.
DRAFT_TOKEN_ID = -2


@dataclass(slots=True)
class ScheduledSequence:
    request_id: str
    token_ids: list[int]            # the tokens to compute this step: all_tokens[start : start + n];
                                    # the last may be PLACEHOLDER_TOKEN_ID (sampled by the step before)
    start_position: int             # tokens already in the KV cache (num_computed_tokens)
    block_table: list[int]          # block ids covering start_position + len(token_ids) tokens
    sample: bool                    # True when this step ends at the sequence's last known token
    params: WireSamplingParams
    prompt_token_ids: list[int]     # references, not copies: penalties read them
    output_token_ids: list[int]
    want_prompt_logprobs: bool = False   # this chunk lies in the prompt and the request asked for them
    banned_token_ids: tuple[int, ...] = ()   # -inf at this sample: EOS and stop ids before min_tokens
    num_draft_tokens: int = 0       # speculative decoding: the last d token_ids are drafts to verify
    stop_ids: tuple[int, ...] = ()  # a drafted step's: EOS (unless ignored), stop ids (a burst stops at them)
    lora_slot: int = -1             # the device slot of its LoRA adapter (-1: the base model)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def banned_rows(self) -> int:
        """How many of this sample's rows ban `banned_token_ids`: with drafts, row j samples output
        token len(output) + j, banned while that is before min_tokens (a drafted sequence is
        launched at once and has no placeholder: its output list is complete then)."""
        if not self.banned_token_ids:
            return 0
        return max(1, self.params.min_tokens - len(self.output_token_ids))

    @property
    def prompt_logprob_rows(self) -> int:
        """Rows of this chunk whose logits give prompt logprobs: row j predicts prompt token
        start + j + 1, so the chunk stops counting at the prompt's end. (A worker's
        `WorkerSequence` carries the same number as a field.)"""
        if not self.want_prompt_logprobs:
            return 0
        return max(0, min(len(self.token_ids), len(self.prompt_token_ids) - 1 - self.start_position))


@dataclass(slots=True)
class BlockSave:
    """Copy a device block out to the KV tiers before this step's forward may overwrite it."""

    block_id: int
    block_hash: bytes
    remote_only: bool = False       # True: a completed request's block (write-through), not an eviction


@dataclass(slots=True)
class TierLoad:
    """Look `block_hashes` up in the tiers, in order, and restore each hit into `block_ids`."""

    request_id: str
    block_hashes: list[bytes]
    block_ids: list[int]            # device blocks the request alone holds, one per hash


@dataclass(slots=True)
class TierLoadResult:
    request_id: str
    found: list[bool]               # per hash: restored into its device block (a prefix of them counts)


@dataclass(slots=True)
class SchedulerOutput:
    sequences: list[ScheduledSequence] = field(default_factory=list)   # decodes first, then prefills
    finished_request_ids: list[str] = field(default_factory=list)      # finished/aborted since last step
    preempted_request_ids: list[str] = field(default_factory=list)
    # Grammar-constrained sampling rows and their allowed-token bitmask: a numpy int32
    # [len(rows), ceil(V / 32)], bit t of word w allows token 32 * w + t. Rows index the sampling
    # positions: each sequence that samples has 1 + num_draft_tokens of them, in order (without
    # drafts: the sequences that sample). Filled by the engine (core/ knows no grammar engine).
    grammar_rows: list[int] = field(default_factory=list)
    grammar_bitmask: object | None = None
    kv_saves: list[BlockSave] = field(default_factory=list)            # KV tiers only: before the forward
    kv_loads: list[TierLoad] = field(default_factory=list)             # KV tiers only: asynchronous
    lora_loads: list = field(default_factory=list)     # LoRASlotLoad (core/lora_slots.py): before the forward

    @property
    def total_num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences


@dataclass(slots=True)
class ModelRunnerOutput:
    # Only for the sequences that sample: their new tokens, 0..n, and one logprobs entry per token.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)  # per chunk position
    # n-gram bursts (executor/spec/burst.py): per request, (drafts found, accepted) of each iteration
    verify_counts: dict[str, list[int]] = field(default_factory=dict)
