"""Rank roles with speculative decoding: a step's drafted sequences are verified on the device,
the others sample one token as usual.

A sequence scheduled with d drafts holds n tokens: ..., t (its last known token), d_1..d_d. The row
of t predicts d_1, the row of d_j predicts d_{j+1}, and the last row (d_d's) predicts the bonus
token. Every drafted sequence takes k + 1 rows of the LM head (k the step's most drafts; rows past
its own d + 1 repeat its last row), so the head's shape depends on the number of drafted sequences
and the step's k only. Each row is sampled as a decode whose history is the tokens before it
(penalties, grammar masks, logprobs: `verify_batch.py`). Greedy rows compare the argmax with the
drafts (`greedy_verify`); sampled rows are sampled by the plain sampler, each row one draw, and a
draft is accepted while it equals the row's sample before it (for one-hot drafts, which every method
gives, that is the rejection rule: rejection.py). A seeded request's rows draw from its own generator,
in order; `collect` rewinds it to the draws of the tokens it emitted, so its output is the one it has
without speculation, whatever the drafts or the batch. The results (tokens [N, K+1], accepted counts
[N], the logprobs of the tokens at each row when asked for) are copied back behind the step and read
in `collect`: the step still syncs with the host once. Every first-stage rank runs the same LM-head
calls in the same order (the plain rows', the prompt rows', then the verify rows'), for the TP
head's collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from tokenforge.executor.input_batch import device_index
from tokenforge.executor.roles import (Driver, HostCopy, StepInFlight, TPFollower, broadcast_sampled, copy_back,
                                       prompt_logits)
from tokenforge.executor.sampler import LogprobsTensors, SamplerOutput
from tokenforge.executor.sampling_batch import SamplingBatch, upload
from tokenforge.executor.spec.rejection import greedy_verify
from tokenforge.executor.spec.verify_batch import select_masks, split_grammar_rows, verify_sampling_batch


@dataclass(slots=True)
class VerifyRows:
    """A step's drafted sequences and where their rows are (device tensors, one upload)."""

    seqs: list                      # the drafted sequences, in batch order
    rows: torch.Tensor              # [N * (k + 1)] hidden rows: t, d_1..d_d, then the last repeated
    drafts: torch.Tensor            # [N, k] (past num_drafts: any id, ignored)
    num_drafts: torch.Tensor        # [N]
    k: int


def verify_rows(step: StepInFlight, device: torch.device) -> VerifyRows | None:
    """None when no sequence of the step carries drafts."""
    k = max((s.num_draft_tokens for s in step.sched.sequences if s.sample), default=0)
    seqs, rows, drafts, counts = [], [], [], []
    for i, s in enumerate(step.sched.sequences):
        d = s.num_draft_tokens
        if not (s.sample and d):
            continue
        end = step.inputs.query_start_loc[i + 1] - 1          # the last row: the bonus token's
        rows.extend(range(end - d, end + 1))
        rows.extend([end] * (k - d))
        drafts.extend(range(end - d + 1, end + 1))     # the drafts' rows: ids on the device (a draft
        drafts.extend([end] * (k - d))                 # model fills them there), past d ignored
        counts.append(d)
        seqs.append(s)
    if not seqs:
        return None
    n = len(seqs)
    packed = upload(torch.tensor(rows + drafts + counts, dtype=torch.long), device)
    r = n * (k + 1)
    draft_ids = step.inputs.input_ids[packed[r:r + n * k]].view(n, k)
    return VerifyRows(seqs, packed[:r], draft_ids, packed[r + n * k:], k)


def plain_logits(role, step: StepInFlight) -> torch.Tensor | None:
    """[N, V] logits of the last rows of the sequences that sample without drafts (step.sampling)."""
    index = {id(s): i for i, s in enumerate(step.sched.sequences)}
    rows = [step.inputs.query_start_loc[index[id(s)] + 1] - 1 for s in step.sampling]
    if not rows:
        return None
    return role.model.compute_logits(step.hidden[device_index(rows, step.hidden.device)])


def _split_plain(role, step: StepInFlight) -> None:
    step.sampling = [s for s in step.sampling if not s.num_draft_tokens]
    role.previous.rows = {s.request_id: i for i, s in enumerate(step.sampling)}


class SpeculativeFollower(TPFollower):
    def after_forward(self, step: StepInFlight, defer_sampling: bool) -> None:
        plan = verify_rows(step, self.device)
        if plan is None:
            return super().after_forward(step, defer_sampling)
        _split_plain(self, step)
        logits = plain_logits(self, step)
        self.previous.tokens = (torch.empty(len(step.sampling), dtype=torch.long, device=self.device)
                                if logits is not None else None)
        prompt_logits(self, step)
        broadcast_sampled(self, step)
        self.model.compute_logits(step.hidden[plan.rows])     # rank 0 verifies; this rank joins the head


@dataclass(slots=True)
class VerifyInFlight:
    """A verify's results on their way to the host."""

    seqs: list                      # the drafted sequences, in batch order
    host: HostCopy                  # token_ids [N, k + 2]: the tokens, then the accepted count;
                                    # logprobs over the N * (k + 1) rows (None: nobody asked)
    k: int
    rewinds: list = field(default_factory=list)   # (index in seqs, its generator, its state before the verify)
    vocab_size: int = 0

    def take(self, out) -> None:
        take_verified(self, out)


class SpeculativeDriver(Driver):
    def after_forward(self, step: StepInFlight, defer_sampling: bool) -> None:
        plan = verify_rows(step, self.device)
        if plan is None:
            return super().after_forward(step, defer_sampling)
        if defer_sampling:
            raise RuntimeError("a step with drafts is never launched ahead: nothing defers its sampling")
        sched = step.sched
        grammar = split_grammar_rows(step.sampling, sched.grammar_rows, plan.k) if sched.grammar_rows else None
        _split_plain(self, step)
        step.logits = plain_logits(self, step)
        if grammar is not None:
            sched = replace(sched, grammar_rows=grammar.plain_rows,
                            grammar_bitmask=select_masks(sched.grammar_bitmask, grammar.plain_masks))
        self._finish_launch(step, sched)
        generators = [self._generator(s) for s in plan.seqs]
        # a seeded request's state before its rows draw: `collect` rewinds it to its emitted tokens' draws
        rewinds = [(i, g, g.get_state()) for i, g in enumerate(generators) if g is not None]
        batch = verify_sampling_batch(
            plan.seqs, plan.drafts, plan.k, self.vocab_size, self.device,
            grammar_rows=grammar and grammar.verify_rows,
            grammar_bitmask=grammar and select_masks(step.sched.grammar_bitmask, grammar.verify_masks),
            generators=generators)
        tokens, accepted, logprobs = self.verify(plan, self.model.compute_logits(step.hidden[plan.rows]), batch)
        result = torch.cat([tokens, accepted[:, None]], dim=1)                     # [N, k + 2]
        step.verify = VerifyInFlight(plan.seqs, copy_back(SamplerOutput(result, logprobs), self.device), plan.k,
                                     rewinds, self.vocab_size)

    def verify(self, plan: VerifyRows, logits: torch.Tensor,
               batch: SamplingBatch | None) -> tuple[torch.Tensor, torch.Tensor, LogprobsTensors | None]:
        """logits [N * (k + 1), V] -> (tokens [N, k + 1], accepted [N], logprobs of the tokens at
        each row or None), on the device. Each row emits what the sampler gives for it (the
        argmax, or a draw from the target's distribution there: rejection.py says why that is the
        rejection rule for one-hot drafts). `batch` None: every row takes the raw argmax."""
        n, k = len(plan.seqs), plan.k
        if batch is None or batch.argmax_only:
            return *greedy_verify(logits.argmax(dim=-1).view(n, k + 1), plan.drafts, plan.num_drafts), None
        out = self.sampler(logits, batch)                                  # one token per row [N * (k + 1)]
        tokens, accepted = greedy_verify(out.token_ids.view(n, k + 1), plan.drafts, plan.num_drafts)
        return tokens, accepted, out.logprobs

    def collect(self, step: StepInFlight, out) -> None:
        verified, step.verify = step.verify, None
        if isinstance(verified, VerifyInFlight) and verified.host.copied is not None:
            verified.host.copied.synchronize()      # recorded after the plain rows' copies: one wait
        super().collect(step, out)
        if verified is not None:
            verified.take(out)


def take_verified(verified: VerifyInFlight, out) -> None:
    """Each drafted sequence's emitted tokens (its accepted drafts and one more) and their logprobs;
    each seeded generator rewound to the draws of the tokens its request emitted."""
    rows = verified.host.token_ids.tolist()
    for i, gen, state in verified.rewinds:
        rewind(gen, state, rows[i][-1] + 1, verified.vocab_size)
    lps = verified.host.logprobs
    positions = lps.to_position_logprobs() if lps is not None else None
    for i, (s, row) in enumerate(zip(verified.seqs, rows)):
        emitted = row[-1] + 1
        out.sampled_token_ids[s.request_id] = row[:emitted]
        if positions is not None and s.params.logprobs is not None:
            first = i * (verified.k + 1)
            out.logprobs[s.request_id] = positions[first:first + emitted]


def rewind(gen: torch.Generator, state: torch.Tensor, draws: int, vocab_size: int) -> None:
    """Set `gen` to where `draws` sampler draws ([V] each, as sample_from_probs makes them) from
    `state` leave it: the rows after the emitted tokens drew what later steps must draw again."""
    gen.set_state(state)
    for _ in range(draws):
        torch.rand(vocab_size, device=gen.device, generator=gen)
