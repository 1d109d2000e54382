"""Test doubles for tests/core: a deterministic fake model runner over a fake paged KV cache.

The fake runner writes each computed token into its KV slot (block_table[p // bs] * bs + p % bs)
and samples next = f(all previous tokens) by *reading the context back from those slots*. So a
wrong block table, a wrongly shared prefix block or a bad recompute after preemption changes the
output, and comparing outputs against `reference_generate` catches it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenforge.config import CacheConfig, SchedulerConfig
from tokenforge.core.block_pool import BlockPool
from tokenforge.core.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SchedulerOutput
from tokenforge.core.scheduler import Scheduler
from tokenforge.messages import EngineCoreOutput, EngineCoreRequest, PositionLogprobs, WireSamplingParams

VOCAB = 97


def next_token(context: Sequence[int]) -> int:
    """The fake model: a deterministic function of every previous token."""
    h = 7
    for t in context:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return h % VOCAB


def reference_generate(prompt: Sequence[int], num_tokens: int) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(num_tokens):
        out.append(next_token(tokens))
        tokens.append(out[-1])
    return out


def fake_prompt_logprob(token: int) -> PositionLogprobs:
    return PositionLogprobs(token_ids=[token], logprobs=[-1.0], ranks=[1])


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, pool: BlockPool | None = None,
                 tokens_per_step: int = 1) -> None:
        self.block_size = block_size
        # >1: each sampling sequence returns that many tokens, as if a proposer's guesses were all
        # accepted (the first from the KV slots, the rest continuing the same function).
        self.tokens_per_step = tokens_per_step
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.pool = pool                      # when given, check that writes hit private blocks
        self.num_steps = 0
        self.prev_sampled: dict[str, int] = {}   # the last step's sampled ids ("on the device")

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        bs = self.block_size
        for seq in so.sequences:
            table = seq.block_table
            for j, tok in enumerate(seq.token_ids):
                p = seq.start_position + j
                if tok == PLACEHOLDER_TOKEN_ID:       # as the real runner: the previous step's id
                    assert j == len(seq.token_ids) - 1, "only the last token may be a placeholder"
                    tok = self.prev_sampled[seq.request_id]
                if self.pool is not None:
                    block = self.pool.blocks[table[p // bs]]
                    # Blocks are registered when scheduled, so a request admitted in the same step
                    # may already share a block this step fills (the device stores a layer's KV
                    # before any attention reads it). A shared block must then be registered for
                    # exactly the token being written.
                    if block.ref_cnt != 1:
                        assert block.block_hash is not None and block.token_ids[p % bs] == tok, \
                            "write into a shared block"
                self.slots[table[p // bs] * bs + p % bs] = tok
            end = seq.start_position + len(seq.token_ids)
            if seq.sample:
                context = [self.slots[table[p // bs] * bs + p % bs] for p in range(end)]
                tokens = [next_token(context)]
                for _ in range(self.tokens_per_step - 1):
                    context.append(tokens[-1])
                    tokens.append(next_token(context))
                out.sampled_token_ids[seq.request_id] = tokens
            if seq.want_prompt_logprobs:
                # index j scores the token at start + j + 1; the last one may lie past the prompt
                prompt = seq.prompt_token_ids
                out.prompt_logprobs[seq.request_id] = [
                    fake_prompt_logprob(prompt[p + 1]) for p in range(seq.start_position, end)
                    if p + 1 < len(prompt)]
        self.num_steps += 1
        self.prev_sampled = {rid: tokens[0] for rid, tokens in out.sampled_token_ids.items()}
        return out


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 32, max_model_len: int = 256,
                   enable_prefix_caching: bool = True, pipeline_steps: int = 1) -> Scheduler:
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len, pipeline_steps=pipeline_steps)
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(sc, cc, num_blocks)


def make_request(rid: str, prompt: Sequence[int], max_tokens: int = 8, eos: tuple[int, ...] = (),
                 salt: str | None = None, **params) -> EngineCoreRequest:
    return EngineCoreRequest(rid, list(prompt), WireSamplingParams(max_tokens=max_tokens, **params),
                             eos_token_ids=eos, cache_salt=salt)


@dataclass
class RunResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    num_cached: dict[str, int] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)
    num_preempted_in_flight: int = 0     # async: tokens that arrived for an already-preempted request


def step(sched: Scheduler, runner: FakeRunner, result: RunResult) -> SchedulerOutput:
    so = sched.schedule()
    assert so.total_num_tokens <= sched.config.max_num_batched_tokens
    assert len(so.sequences) <= sched.config.max_num_seqs
    n_decode = sum(1 for s in so.sequences if s.num_tokens == 1)
    assert all(s.num_tokens == 1 for s in so.sequences[:n_decode]), "decodes must come first"
    record(result, sched.update_from_output(so, runner.execute(so)))
    result.steps.append(so)
    return so


def run_async_to_completion(sched: Scheduler, runner: FakeRunner | None = None,
                            result: RunResult | None = None, max_steps: int = 10_000) -> RunResult:
    """EngineCore's async loop: step N+1 is scheduled (and run) before step N's update."""
    runner = runner or FakeRunner(sched.num_kv_blocks, sched.block_size, sched.kv.pool)
    result = result or RunResult()
    in_flight = None
    for _ in range(max_steps):
        if in_flight is None and not sched.has_unfinished_requests():
            break
        if in_flight is None:
            so = sched.schedule()
            in_flight = (so, runner.execute(so))
        ahead = None
        if sched.can_schedule_ahead():
            so = sched.schedule()
            assert so.total_num_tokens <= sched.config.max_num_batched_tokens
            if so.sequences:
                ahead = (so, runner.execute(so))
        result.num_preempted_in_flight += sum(
            1 for s in in_flight[0].sequences
            if s.sample and s.request_id in sched.requests and sched.requests[s.request_id].status.name == "PREEMPTED")
        record(result, sched.update_from_output(*in_flight))
        result.steps.append(in_flight[0])
        in_flight = ahead
    else:
        raise AssertionError("the scheduler made no progress")
    assert_pool_idle(sched)
    return result


def record(result: RunResult, outputs: list[EngineCoreOutput]) -> None:
    for o in outputs:
        assert o.request_id not in result.finish, "output after the request finished"
        result.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.prompt_logprobs:
            result.prompt_logprobs.setdefault(o.request_id, []).extend(o.prompt_logprobs)
        result.num_cached[o.request_id] = o.num_cached_tokens
        if o.finished:
            result.finish[o.request_id] = (o.finish_reason, o.stop_token_id)


def run_to_completion(sched: Scheduler, runner: FakeRunner | None = None,
                      result: RunResult | None = None, max_steps: int = 10_000) -> RunResult:
    runner = runner or FakeRunner(sched.num_kv_blocks, sched.block_size, sched.kv.pool)
    result = result or RunResult()
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        step(sched, runner, result)
    else:
        raise AssertionError("the scheduler made no progress")
    assert_pool_idle(sched)
    return result


def assert_pool_idle(sched: Scheduler) -> None:
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_blocks, "blocks leaked"
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not sched.requests and not sched.running and not sched.waiting
