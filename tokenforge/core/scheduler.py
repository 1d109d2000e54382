"""The scheduler: which tokens of which requests to compute each step.

In: `EngineCoreRequest`s (add_request), aborts, and each step's `ModelRunnerOutput`.
Out: a `SchedulerOutput` per step (schedule) and `EngineCoreOutput`s (update_from_output).

It schedules tokens, not phases: running requests first (decodes and unfinished prefill chunks),
then waiting ones in FCFS order, under a token budget (`max_num_batched_tokens`) and a sequence
budget (`max_num_seqs`). Long prompts are chunked to the budget left. When the pool runs dry it
preempts the newest running request by recompute: its blocks are freed and it goes back to the
front of the queue, to recompute prompt + output later, token for token.

Async scheduling: `schedule()` may run again before the previous step's output has arrived
(the engine does this while the device works). A step advances `num_computed_tokens` when it is
scheduled, and a sequence that samples leaves a placeholder: the next step computes that
placeholder token (PLACEHOLDER_TOKEN_ID in `token_ids`; the runner takes its id from the device),
and `update_from_output` replaces the placeholder with the real token. Requests whose sampling
reads their own output history (penalties) or that want prompt logprobs need each step's output
before the next is scheduled: while any is unfinished, `can_schedule_ahead()` is False. Grammar
requests do not: the engine defers only the sampling of a step scheduled ahead until the masks,
which need the step before's tokens, are computed (engine/structured_output.py).

Pipelined steps (pipeline parallelism, `pipeline_steps` K > 1): up to K steps are in flight at
once, each over a disjoint set of requests, so the first stage runs one step's layers while later
stages run another's. A request in a step still in flight (`_busy`) is not scheduled again until
that step's output is in, so no step carries placeholders. Each step takes about 1/K of the
unfinished requests (at most `max_num_seqs`; up to K x `max_num_seqs` run at once), so the steps
in flight stay balanced. Preempting or aborting a request in flight is safe as under async
scheduling: every stage runs the steps in order, so a freed block is written by the old step
before the new one touches it.

min_tokens: below it, a sequence bans EOS (unless ignore_eos) and stop ids. LoRA: running requests
hold their adapters' slots (core/lora_slots.py). Drafts take free KV slots only, never preempting."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from math import ceil

from tokenforge.config import CacheConfig, SchedulerConfig
from tokenforge.core.kv_cache_manager import KVCacheManager, cdiv
from tokenforge.core.kv_tiers import KVTierPolicy
from tokenforge.core.lora_slots import LoRASlotTable
from tokenforge.core.outputs import (PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, ScheduledSequence,
                                     SchedulerOutput, TierLoadResult)
from tokenforge.core.prompt_logprobs import take_prompt_logprobs, wants_prompt_logprobs
from tokenforge.core.request import Request, RequestStatus, check_prompt_fits
from tokenforge.core.speculation import DraftPlanner
from tokenforge.core.stop_conditions import append_until_stop, banned_tokens, stop_ids
from tokenforge.messages import EngineCoreOutput, EngineCoreRequest, EngineStats


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_kv_blocks: int, drafts: DraftPlanner | None = None, max_loras: int = 0) -> None:
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.num_kv_blocks = num_kv_blocks
        self.kv = KVCacheManager(num_kv_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        # A sequence can never outgrow the pool either: stopped there, no request preempts itself forever.
        self.max_len = min(scheduler_config.max_model_len, num_kv_blocks * cache_config.block_size)
        self.requests: dict[str, Request] = {}     # every unfinished request
        self.waiting: deque[Request] = deque()     # WAITING and PREEMPTED, in service order
        self.running: list[Request] = []           # in admission order: the newest is last
        self._finished_ids: list[str] = []         # finished or aborted since the last schedule()
        self._num_needs_sync = self.num_preemptions = 0        # unfinished requests with `needs_sync`
        self.pipeline_steps = scheduler_config.pipeline_steps
        self._max_running = scheduler_config.max_num_seqs * self.pipeline_steps
        self._busy: set[str] = set()               # pipelined: ids in a step still in flight
        self.drafts = drafts                       # speculative decoding (None: off)
        self.loras = LoRASlotTable(max_loras)      # LoRA adapters' device slots (0 without --enable-lora)
        self.num_arrivals = 0                      # requests added so far (each one's arrival_seq)
        self.tiers: KVTierPolicy | None = None     # CPU/disk/Redis tiers below the device cache (None: no work)
        if cache_config.kv_tiers_enabled:
            self.tiers = KVTierPolicy(self.kv, cache_config.remote_write_through)
            self.kv.pool.on_evict = self.tiers.on_evict

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, req: EngineCoreRequest) -> None:
        check_prompt_fits(req, self.config.max_model_len, self.block_size, self.num_kv_blocks)
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        request = Request.from_engine_core_request(req)
        p = request.params
        request.needs_sync = p.prompt_logprobs is not None or p.has_penalties
        self._num_needs_sync += request.needs_sync
        request.arrival_seq, self.num_arrivals = self.num_arrivals, self.num_arrivals + 1
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Remove requests wherever they are and free their blocks now; unknown ids are ignored."""
        was_running = was_waiting = False
        now = time.time()
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            was_running |= req.status == RequestStatus.RUNNING
            was_waiting |= req.status != RequestStatus.RUNNING
            req.status, req.finished_time = RequestStatus.FINISHED_ABORTED, now
            self.loras.release(req)
            if self.tiers is None or rid not in self.tiers.loading:   # else freed once loaded
                self.kv.free(req)
            self._num_needs_sync -= req.needs_sync
            self._finished_ids.append(rid)
        # One filtering pass each, so aborting k of n requests costs O(n), not O(k * n).
        if was_running:
            self.running = [r for r in self.running if not r.is_finished]
        if was_waiting:
            self.waiting = deque(r for r in self.waiting if not r.is_finished)

    def has_unfinished_requests(self) -> bool:
        # Tier loads in flight and unsent saves (a finished request's write-through) keep it stepping.
        return bool(self.running or self.waiting or (self.tiers is not None and self.tiers.has_work()))

    def has_unfinished_requests_besides_tiers(self) -> bool:
        return bool(self.running or self.waiting or (self.tiers is not None and self.tiers.loading))

    def num_loading(self) -> int:
        return len(self.tiers.loading) if self.tiers is not None else 0

    def finish_tier_loads(self, results: list[TierLoadResult]) -> None:
        """Loads the executor finished: those requests go back to the head of the queue."""
        for result in reversed(results):
            req = self.tiers.finish_load(result)
            if req is not None:
                self.waiting.appendleft(req)

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before this one's output is known (and drafts none)."""
        return not self._num_needs_sync and (self.drafts is None or self.drafts.allows_step_ahead(len(self.running)))

    def get_num_running(self) -> int:
        return len(self.running)

    def get_num_waiting(self) -> int:
        return len(self.waiting) + self.num_loading()

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            num_running=len(self.running), num_waiting=self.get_num_waiting(),
            kv_usage=pool.usage, kv_fragmentation=self.kv.fragmentation,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits, num_preemptions=self.num_preemptions,
            num_kv_blocks=pool.num_blocks, num_free_blocks=pool.num_free_blocks, spec_decode=self.drafts and self.drafts.snapshot())

    # ---- schedule ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out, self._finished_ids = SchedulerOutput(finished_request_ids=self._finished_ids), []
        if self.drafts is not None:
            # this step's k; whether a waiting request may join it (then no burst: core/speculation.py)
            self.drafts.begin_step(len(self.running), bool(self.waiting) and len(self.running) < self.config.max_num_seqs)
        decodes: list[ScheduledSequence] = []
        prefills: list[ScheduledSequence] = []
        if self.pipeline_steps == 1:
            budget = self._schedule_running(self.config.max_num_batched_tokens, decodes, prefills,
                                            out.preempted_request_ids)
            room = self.config.max_num_seqs - len(self.running)
        else:
            budget, room = self._schedule_idle_running(self.config.max_num_batched_tokens, decodes, prefills,
                                                       out.preempted_request_ids)
            room = min(room, self._max_running - len(self.running))
        # Blocks ran out this step: admitting new work would only preempt it again.
        if not out.preempted_request_ids:
            self._schedule_waiting(budget, room, decodes, prefills)
        decodes.extend(prefills)
        out.sequences = decodes
        if self.pipeline_steps > 1:
            self._busy.update(s.request_id for s in decodes)
        if self.tiers is not None:
            out.kv_saves, out.kv_loads = self.tiers.take_step_ops()
        out.lora_loads = self.loras.take_loads()
        return out

    def _schedule_running(self, budget: int, decodes: list[ScheduledSequence],
                          prefills: list[ScheduledSequence], preempted: list[str]) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            # At most one token the host does not know yet: the one the step in flight samples.
            n = min(req.num_tokens_with_placeholders, req.num_tokens + 1) - req.num_computed_tokens
            if n <= 0 or (req.num_output_placeholders and self._ends_with_pending_token(req)):
                i += 1                 # waits for its tokens in flight, or they are its last
                continue
            n = min(n, budget)
            drafts = (self.drafts.drafts(req, min(budget, self.kv.pool.num_free_blocks * self.block_size), self.max_len)
                      if self.drafts is not None and n == 1 else [])      # drafts take free slots only
            n += len(drafts)
            if not self._allocate_or_preempt(req, n, preempted):
                break
            self._add_sequence(req, n, decodes, prefills, drafts)
            budget -= n
            i += 1
        return budget

    def _schedule_idle_running(self, budget: int, decodes: list[ScheduledSequence],
                               prefills: list[ScheduledSequence], preempted: list[str]) -> tuple[int, int]:
        """Pipelined steps: `_schedule_running` over the running requests no step in flight holds,
        at most this step's share of the unfinished requests. Returns (tokens, sequences) left."""
        room = min(self.config.max_num_seqs,
                   ceil((len(self.running) + len(self.waiting)) / self.pipeline_steps))
        busy, i = self._busy, 0
        while i < len(self.running) and budget > 0 and room > 0:
            req = self.running[i]
            i += 1
            if req.request_id in busy:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            assert n > 0, f"request {req.request_id}: nothing left to compute, yet unfinished"
            if not self._allocate_or_preempt(req, n, preempted):
                break
            self._add_sequence(req, n, decodes, prefills)
            budget -= n
            room -= 1
        return budget, room

    def _ends_with_pending_token(self, req: Request) -> bool:
        """True when the tokens still on the device already reach max_tokens or the length cap."""
        num_out = req.num_output_tokens + req.num_output_placeholders
        return num_out >= req.params.max_tokens or req.num_tokens_with_placeholders >= self.max_len

    def _allocate_or_preempt(self, req: Request, n: int, preempted: list[str]) -> bool:
        """Allocate n slots for a running request, preempting the newest running requests (LIFO)
        until it fits. False when the request had to preempt itself."""
        while self.kv.allocate_slots(req, n) is None:
            # The victim is never one scheduled earlier this step: those sit before `req`.
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        self.loras.release(req)
        req.num_computed_tokens = req.num_tier_hit_tokens = 0
        req.tier_looked_up = False
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _schedule_waiting(self, budget: int, room: int, decodes: list[ScheduledSequence],
                          prefills: list[ScheduledSequence]) -> None:
        """Admit waiting requests FCFS: at most `room` of them and `budget` tokens."""
        now: float | None = None
        no_slot: list[Request] = []             # their adapter finds no free LoRA slot: they wait, others go
        self.loras.begin_schedule(self.waiting, self.num_arrivals)
        while self.waiting and budget > 0 and room > 0:
            req = self.waiting[0]
            if not self.loras.can_admit(req) and not req.num_output_placeholders:
                no_slot.append(self.waiting.popleft())
                continue
            if req.num_output_placeholders or (self._busy and req.request_id in self._busy):
                break                          # preempted with a step in flight: after it
            if self.tiers is not None and self.tiers.should_look_up(req):
                started = self.tiers.start_load(req, reserve=len(self.running))
                if started is None:
                    break
                if started:
                    self.waiting.popleft()     # waits for its load while others run
                    continue
            holds_blocks = self.tiers is not None and bool(self.kv.block_table(req))   # back from a load
            if holds_blocks:
                hit_blocks, num_hit = [], req.num_computed_tokens
            else:
                hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, budget)
            if self.kv.allocate_slots(req, n, hit_blocks) is None:
                if holds_blocks:
                    self._release_restored(req)
                elif self.tiers is not None and not self.running and not self.tiers.loading:
                    # Restored requests behind the head hold the blocks it needs, and nothing else
                    # will free any: they give theirs back (still in the prefix cache).
                    for other in self.waiting:
                        if other is not req and self.kv.block_table(other):
                            self._release_restored(other)
                break                          # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.kv.record_prefix_lookup(req, num_hit - req.num_tier_hit_tokens)
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now = now or time.time()
                req.num_cached_tokens = num_hit
            self.running.append(req)
            self.loras.acquire(req)
            self._add_sequence(req, n, decodes, prefills)
            budget -= n
            room -= 1
        self.waiting.extendleft(reversed(no_slot))

    def _release_restored(self, req: Request) -> None:
        """A waiting request must not hold blocks the running ones need (nothing could preempt it):
        its restored blocks stay in the prefix cache, where its next lookup may find them. Those
        the running requests take meanwhile are still in the tiers: it may look them up again."""
        self.kv.free(req)
        req.num_computed_tokens = req.num_tier_hit_tokens = 0
        req.tier_looked_up = False

    def _add_sequence(self, req: Request, n: int, decodes: list[ScheduledSequence],
                      prefills: list[ScheduledSequence], drafts: list[int] = ()) -> None:
        start, tokens = req.num_computed_tokens, req.all_token_ids
        end = start + n
        known_end = end - len(drafts)     # drafts follow the last known token: the runner verifies them
        token_ids = tokens[start:known_end]
        if known_end > len(tokens):     # the token the step in flight samples: the runner fills it in
            token_ids.extend([PLACEHOLDER_TOKEN_ID] * (known_end - len(tokens)))
        token_ids.extend(drafts)
        sample = known_end == req.num_tokens_with_placeholders
        seq = ScheduledSequence(
            request_id=req.request_id, token_ids=token_ids, start_position=start, block_table=self.kv.block_table(req),
            sample=sample, params=req.params, stop_ids=stop_ids(req) if drafts else (),
            prompt_token_ids=req.prompt_token_ids, output_token_ids=req.output_token_ids,
            want_prompt_logprobs=req.params.prompt_logprobs is not None and wants_prompt_logprobs(req, start),
            banned_token_ids=banned_tokens(req) if sample else (), num_draft_tokens=len(drafts), lora_slot=req.lora_slot)
        req.num_computed_tokens = end
        req.num_output_placeholders += sample
        # Register the blocks this step fills now, not at its update: a request scheduled next (maybe
        # before this step's output is back) can hit them; steps run in order, so KV is written first.
        self.kv.cache_blocks(req)
        (decodes if n == 1 else prefills).append(seq)

    # ---- update --------------------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Turn a finished step's placeholders into tokens; stop requests that are done.

        A request preempted after this step was scheduled (async scheduling) still receives the
        token the step sampled for it: the token is valid, only its KV was dropped.
        """
        outputs: list[EngineCoreOutput] = []
        now, finished_running, finished_waiting = time.time(), False, False
        if self.pipeline_steps > 1:
            self._busy.difference_update(s.request_id for s in scheduler_output.sequences)
        out = model_runner_output
        sampled, logprobs, bursts = out.sampled_token_ids, out.logprobs, out.verify_counts
        for seq in scheduler_output.sequences:
            req = self.requests.get(seq.request_id)
            if req is None:
                continue                       # finished or aborted since it was scheduled
            running = req.status == RequestStatus.RUNNING
            prompt_lps = take_prompt_logprobs(req, seq, model_runner_output) if seq.want_prompt_logprobs else None
            tokens, status = (), None
            if seq.sample:
                req.num_output_placeholders -= 1
                tokens, status = append_until_stop(req, sampled[req.request_id], self.max_len)
                if seq.num_draft_tokens:
                    self.drafts.count_verify(seq.num_draft_tokens, len(tokens), bursts.get(req.request_id))
                    if running and status is None:     # back to the valid KV: rejected drafts' slots go
                        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
                        self.kv.truncate(req, cdiv(req.num_tokens, self.block_size))
                if not tokens and running and not req.num_output_placeholders:
                    req.num_computed_tokens -= 1   # nothing sampled: the next step samples its last token again
            if running:
                self.kv.cache_blocks(req)
            if not tokens:
                if prompt_lps:
                    outputs.append(EngineCoreOutput(req.request_id, [], prompt_logprobs=prompt_lps,
                                                    num_cached_tokens=req.num_cached_tokens))
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            if status is not None:
                self._finish(req, status, now)
                finished_running |= running
                finished_waiting |= not running
            lps = logprobs.get(req.request_id)
            if lps is not None and len(lps) > len(tokens):
                lps = lps[:len(tokens)]        # a stop cut the list short
            outputs.append(EngineCoreOutput(
                req.request_id, tokens, lps, prompt_logprobs=prompt_lps,
                finish_reason=status.finish_reason.value if status is not None else None,
                stop_token_id=req.stop_token_id, num_cached_tokens=req.num_cached_tokens))
        if finished_running:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        if finished_waiting:
            self.waiting = deque(r for r in self.waiting if not r.is_finished)
        return outputs

    def _finish(self, req: Request, status: RequestStatus, now: float) -> None:
        req.status, req.finished_time = status, now
        self.loras.release(req)
        if self.tiers is not None:
            self.tiers.on_finish(self.kv.registered_blocks(req))
        self.kv.free(req)
        self._num_needs_sync -= req.needs_sync
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
