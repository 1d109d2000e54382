"""Rank roles: what a rank does after a step's forward, chosen once at start-up (`make_role`).

In: a launched step (`StepInFlight`) whose forward is queued, its hidden states on the first
stage. Out: on the driver, the step's sampled ids (kept on the device for the next step's
placeholders, copied back for `collect`); on the other ranks, their part of the collectives.
- `Driver` (rank 0): the logits of the rows that sample, the sampling (deferred until `sample`
  when the grammar masks wait for the step before), prompt logits, the broadcast of the sampled
  ids to its TP peers, the copy back to the host, and `collect` (the one host sync per step).
- `TPFollower` (the first stage's other ranks): the LM head's collectives for the same rows in the
  same order, then rank 0's sampled ids by broadcast (its next step's placeholders).
- `LaterStage` (pipeline stages after the first): nothing; the first stage holds the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenforge.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenforge.distributed import parallel_state
from tokenforge.executor.input_batch import InputBatch
from tokenforge.executor.sampler import (LogprobsTensors, Sampler, SamplerOutput, SamplingBatch,
                                        compute_prompt_logprobs)


@dataclass(slots=True)
class HostCopy:
    """A step's sampled ids (and logprobs) on their way to the host."""

    token_ids: torch.Tensor                     # [N]
    logprobs: LogprobsTensors | None
    copied: torch.cuda.Event | None             # recorded after the copies (CUDA only)


@dataclass(slots=True)
class StepInFlight:
    """A launched step: device tensors not yet copied back to the host."""

    sched: object                               # SchedulerOutput (rank 0) or WorkerStep
    inputs: InputBatch | None = None
    hidden: torch.Tensor | None = None          # [T, hidden] on the first stage
    sampling: list = field(default_factory=list)   # the sequences that sample, in row order
    logits: torch.Tensor | None = None          # [N, V] of the sampling rows until they are sampled
    sampler_output: SamplerOutput | None = None
    host: HostCopy | None = None
    prompt_logits: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)   # (seq, rows, [rows, V])
    awaits_last_stage: bool = False             # pipelined first stage: `finish_stages` brings its hidden states
    verify: object | None = None                # speculative decoding: its VerifyInFlight (spec/roles.py)
    accepted_rows: torch.Tensor | None = None   # tree drafts: the accepted path's rows (spec/tree_verify.py)

    @property
    def sample_pending(self) -> bool:
        """Launched with defer_sampling and not sampled yet."""
        return self.logits is not None


def make_role(runner):
    rank = runner.rank
    if rank.is_driver:
        return Driver(runner)
    return TPFollower(runner) if rank.is_first_stage else LaterStage(runner)


class LaterStage:
    is_driver = False

    def __init__(self, runner) -> None:
        # What the role works with, not the runner itself: no reference cycle, so an engine's
        # weights and KV cache are freed as soon as it is dropped.
        self.rank, self.device, self.model = runner.rank, runner.device, runner.model
        self.previous, self.vocab_size, self.config = runner.previous, runner.vocab_size, runner.config

    def check_launch(self) -> None:
        pass

    def forget(self, request_ids: list[str]) -> None:
        pass

    def after_forward(self, step: StepInFlight, defer_sampling: bool) -> None:
        pass


class TPFollower(LaterStage):
    def after_forward(self, step: StepInFlight, defer_sampling: bool) -> None:
        r = self
        # Rank 0 samples; this rank takes part in the LM head's collectives, then its broadcast.
        tokens = None
        if sampling_logits(r, step) is not None:
            tokens = torch.empty(len(step.sampling), dtype=torch.long, device=r.device)
        r.previous.tokens = tokens
        prompt_logits(r, step)
        broadcast_sampled(r, step)


class Driver(LaterStage):
    is_driver = True

    def __init__(self, runner) -> None:
        super().__init__(runner)
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}    # seeded requests, by id
        self.deferred: StepInFlight | None = None           # launched, its sampling not queued yet
        # Grammar bitmasks travel from reused host slots (pinned on CUDA), in turn: the upload of
        # one step's mask may still be queued while the next step's mask is filled.
        self._mask_slots: torch.Tensor | None = None        # [slots, rows, ceil(V / 32)] int32
        self._mask_slot = 0

    def check_launch(self) -> None:
        if self.deferred is not None:
            raise RuntimeError("a step was launched before the previous one was sampled")

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.generators.pop(rid, None)

    def after_forward(self, step: StepInFlight, defer_sampling: bool) -> None:
        step.logits = sampling_logits(self, step)
        if defer_sampling and step.logits is not None:
            prompt_logits(self, step)     # the LM head's collectives keep the workers' order
            self.deferred = step
            return
        self._finish_launch(step, step.sched)

    def sample(self, step: StepInFlight, sched: SchedulerOutput) -> None:
        """Queue the sampling of a step launched with `defer_sampling` (a no-op for any other)."""
        if not step.sample_pending:
            return
        self.deferred = None
        self._finish_launch(step, sched, prompt_logits_done=True)

    def _finish_launch(self, step: StepInFlight, sched: SchedulerOutput, prompt_logits_done: bool = False) -> None:
        r = self
        logits, step.logits = step.logits, None
        if logits is not None:
            step.sampler_output = self.sampler(logits, self._sampling_batch(step, sched))
        r.previous.tokens = step.sampler_output.token_ids if step.sampler_output is not None else None
        if not prompt_logits_done:
            prompt_logits(r, step)
        broadcast_sampled(r, step)
        step.host = copy_back(step.sampler_output, r.device)

    def _sampling_batch(self, step: StepInFlight, sched: SchedulerOutput) -> SamplingBatch:
        seqs = step.sampling
        return SamplingBatch.build(
            [s.params for s in seqs], [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs],
            [self._generator(s) for s in seqs], self.vocab_size, self.device,
            banned=[s.banned_token_ids for s in seqs], grammar_rows=sched.grammar_rows,
            grammar_bitmask=sched.grammar_bitmask)

    def _generator(self, seq) -> torch.Generator | None:
        if seq.params.seed is None or seq.params.is_greedy:
            return None
        gen = self.generators.get(seq.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seq.params.seed)
            self.generators[seq.request_id] = gen
        return gen

    def collect(self, step: StepInFlight, out: ModelRunnerOutput) -> None:
        """Wait for the step's copies and turn them into lists: one token per sampling row."""
        host = step.host
        if host is not None:
            if host.copied is not None:
                host.copied.synchronize()    # this step only: a step queued after it keeps the device busy
            for s, tok in zip(step.sampling, host.token_ids.tolist()):
                out.sampled_token_ids[s.request_id] = [tok]
            if host.logprobs is not None:
                for s, pos in zip(step.sampling, host.logprobs.to_position_logprobs()):
                    if s.params.logprobs is not None:
                        out.logprobs[s.request_id] = [pos]
        device = self.device
        for i, n, logits in step.prompt_logits:
            s = step.sched.sequences[i]
            targets = torch.tensor(s.prompt_token_ids[s.start_position + 1:s.start_position + 1 + n], device=device)
            out.prompt_logprobs[s.request_id] = compute_prompt_logprobs(logits, targets, s.params.prompt_logprobs)

    def grammar_bitmask_buffer(self, rows: int, width: int):
        """A host array [rows, width] int32 for a step's grammar bitmask: a view of a reused slot
        (pinned on CUDA, so its upload is one asynchronous copy). A slot is reused once the step
        that uploaded from it was collected: two slots, or K + 1 with K pipelined steps."""
        slots, cfg = self._mask_slots, self.config
        if slots is None or slots.shape[1] < rows or slots.shape[2] != width:
            # speculative decoding: a drafted sequence has a mask per draft position too
            cap = max(rows, cfg.scheduler.max_num_seqs * (1 + cfg.scheduler.num_draft_tokens))
            count = max(2, cfg.scheduler.pipeline_steps + 1)
            slots = torch.empty((count, cap, width), dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self._mask_slots = slots
        self._mask_slot = (self._mask_slot + 1) % slots.shape[0]
        return slots[self._mask_slot, :rows].numpy()


def sampling_logits(role, step: StepInFlight) -> torch.Tensor | None:
    """[N, V] logits of the rows that sample (None when none does)."""
    rows = [i for i, s in enumerate(step.sched.sequences) if s.sample]
    if not rows:
        return None
    return role.model.compute_logits(step.hidden[step.inputs.last_token_index(rows)])


def prompt_logits(role, step: StepInFlight) -> None:
    """Logits of the prompt rows that asked for logprobs, taken at launch so that every TP rank
    runs the LM head's collective in the same order (a worker's sequences carry the row counts)."""
    for i, s in enumerate(step.sched.sequences):
        n = s.prompt_logprob_rows
        if n <= 0:
            continue
        start = step.inputs.query_start_loc[i]
        step.prompt_logits.append((i, n, role.model.compute_logits(step.hidden[start:start + n])))


def broadcast_sampled(role, step: StepInFlight) -> None:
    if role.rank.tp_size > 1 and step.sampling:
        # Every rank of the first stage embeds the next step's placeholders: one source of truth.
        torch.distributed.broadcast(role.previous.tokens, src=0, group=parallel_state.tp_group())


def copy_back(out: SamplerOutput | None, device: torch.device) -> HostCopy | None:
    """Queue the device-to-host copies of the sampled ids (and logprobs) behind the step."""
    if out is None:
        return None
    if device.type != "cuda":
        return HostCopy(out.token_ids, out.logprobs, None)
    token_ids, lp = out.token_ids.to("cpu", non_blocking=True), out.logprobs
    if lp is not None:
        lp = LogprobsTensors(lp.token_ids.to("cpu", non_blocking=True), lp.logprobs.to("cpu", non_blocking=True),
                             lp.sampled_rank.to("cpu", non_blocking=True), lp.num_logprobs)
    host = HostCopy(token_ids, lp, torch.cuda.Event())
    host.copied.record()
    return host
