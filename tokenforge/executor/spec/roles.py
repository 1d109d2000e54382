"""Rank roles with speculative decoding: a step's drafted sequences are verified on the device,
the others sample one token as usual.

A sequence scheduled with d drafts holds n tokens: ..., t (its last known token), d_1..d_d. The row
of t predicts d_1, the row of d_j predicts d_{j+1}, and the last row (d_d's) predicts the bonus
token. Every drafted sequence takes k + 1 rows of the LM head (k the step's most drafts; rows past
its own d + 1 repeat its last row), so the head's shape depends on the number of drafted sequences
and the step's k only. Each row is sampled as a decode whose history is the tokens before it
(penalties, grammar masks, logprobs: `verify_batch.py`). Greedy rows compare the argmax with the
drafts (`greedy_verify`); sampled rows go through the rejection rule with the bonus token drawn from
the last real row. The results (tokens [N, K+1], accepted counts [N], the logprobs of the tokens at
each row when asked for) are copied back behind the step and read in `collect`: the step still syncs
with the host once. Every first-stage rank runs the same LM-head calls in the same order (the plain
rows', the prompt rows', then the verify rows'), for the TP head's collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tokenforge.executor.roles import (Driver, HostCopy, StepInFlight, TPFollower, broadcast_sampled, copy_back,
                                       prompt_logits)
from tokenforge.executor.sampler import (LogprobsTensors, SamplerOutput, apply_min_p, apply_top_k_top_p,
                                        gather_logprobs, processed_logits)
from tokenforge.executor.sampling_batch import SamplingBatch, upload
from tokenforge.executor.spec.rejection import greedy_verify, rejection_verify, sample
from tokenforge.executor.spec.verify_batch import select_masks, split_grammar_rows, verify_sampling_batch


def make_speculative_role(runner):
    return SpeculativeDriver(runner) if runner.rank.is_driver else SpeculativeFollower(runner)


@dataclass(slots=True)
class VerifyRows:
    """A step's drafted sequences and where their rows are (device tensors, one upload)."""

    seqs: list                      # the drafted sequences, in batch order
    rows: torch.Tensor              # [N * (k + 1)] hidden rows: t, d_1..d_d, then the last repeated
    drafts: torch.Tensor            # [N, k] (past num_drafts: any id, ignored)
    num_drafts: torch.Tensor        # [N]
    greedy: torch.Tensor            # [N] bool
    k: int


def verify_rows(step: StepInFlight, device: torch.device, driver: bool = True) -> VerifyRows | None:
    """None when no sequence of the step carries drafts. `driver`: the sequences carry their
    sampling params (a TP worker's do not; it needs the rows only)."""
    k = max((s.num_draft_tokens for s in step.sched.sequences if s.sample), default=0)
    seqs, rows, drafts, counts, greedy = [], [], [], [], []
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
        greedy.append(int(s.params.is_greedy) if driver else 0)
        seqs.append(s)
    if not seqs:
        return None
    n = len(seqs)
    packed = upload(torch.tensor(rows + drafts + counts + greedy, dtype=torch.long), device)
    r = n * (k + 1)
    draft_ids = step.inputs.input_ids[packed[r:r + n * k]].view(n, k)
    return VerifyRows(seqs, packed[:r], draft_ids, packed[r + n * k:r + n * k + n], packed[r + n * k + n:].bool(), k)


def plain_logits(role, step: StepInFlight) -> torch.Tensor | None:
    """[N, V] logits of the last rows of the sequences that sample without drafts (step.sampling)."""
    index = {id(s): i for i, s in enumerate(step.sched.sequences)}
    rows = [step.inputs.query_start_loc[index[id(s)] + 1] - 1 for s in step.sampling]
    if not rows:
        return None
    return role.model.compute_logits(step.hidden[torch.tensor(rows, device=step.hidden.device)])


def _split_plain(role, step: StepInFlight) -> None:
    step.sampling = [s for s in step.sampling if not s.num_draft_tokens]
    role.previous.rows = {s.request_id: i for i, s in enumerate(step.sampling)}


class SpeculativeFollower(TPFollower):
    def after_forward(self, step: StepInFlight, defer_sampling: bool) -> None:
        plan = verify_rows(step, self.device, driver=False)
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
        batch = verify_sampling_batch(
            plan.seqs, plan.drafts, plan.k, self.vocab_size, self.device,
            grammar_rows=grammar and grammar.verify_rows,
            grammar_bitmask=grammar and select_masks(step.sched.grammar_bitmask, grammar.verify_masks))
        tokens, accepted, logprobs = self.verify(plan, self.model.compute_logits(step.hidden[plan.rows]), batch)
        result = torch.cat([tokens, accepted[:, None]], dim=1)                     # [N, k + 2]
        step.verify = VerifyInFlight(plan.seqs, copy_back(SamplerOutput(result, logprobs), self.device), plan.k)

    def verify(self, plan: VerifyRows, logits: torch.Tensor,
               batch: SamplingBatch | None) -> tuple[torch.Tensor, torch.Tensor, LogprobsTensors | None]:
        """logits [N * (k + 1), V] -> (tokens [N, k + 1], accepted [N], logprobs of the tokens at
        each row or None), on the device. `batch` None: every row takes the raw argmax."""
        n, k = len(plan.seqs), plan.k
        if batch is None or batch.argmax_only:
            return *greedy_verify(logits.argmax(dim=-1).view(n, k + 1), plan.drafts, plan.num_drafts), None
        logits, raw_logprobs = processed_logits(logits, batch)            # [N * (k + 1), V]
        if batch.all_greedy:
            tokens, accepted = greedy_verify(logits.argmax(dim=-1).view(n, k + 1), plan.drafts, plan.num_drafts)
        else:
            probs = target_probs(logits, batch).view(n, k + 1, -1)                 # [N, k + 1, V]
            last = probs[torch.arange(n, device=probs.device), plan.num_drafts]    # [N, V]
            bonus = torch.where(plan.greedy, last.argmax(dim=1), sample(last, None))
            tokens, accepted = rejection_verify(probs[:, :k], plan.drafts, plan.num_drafts, plan.greedy, bonus)
        if raw_logprobs is None:
            return tokens, accepted, None
        return tokens, accepted, gather_logprobs(raw_logprobs, tokens.reshape(-1), batch.max_num_logprobs,
                                                 batch.num_logprobs)

    def collect(self, step: StepInFlight, out) -> None:
        verified, step.verify = step.verify, None
        if verified is not None and verified.host.copied is not None:
            verified.host.copied.synchronize()      # recorded after the plain rows' copies: one wait
        super().collect(step, out)
        if verified is not None:
            take_verified(verified, out)


def take_verified(verified: VerifyInFlight, out) -> None:
    """Each drafted sequence's emitted tokens (its accepted drafts and one more) and their logprobs."""
    rows = verified.host.token_ids.tolist()
    lps = verified.host.logprobs
    positions = lps.to_position_logprobs() if lps is not None else None
    for i, (s, row) in enumerate(zip(verified.seqs, rows)):
        emitted = row[-1] + 1
        out.sampled_token_ids[s.request_id] = row[:emitted]
        if positions is not None and s.params.logprobs is not None:
            first = i * (verified.k + 1)
            out.logprobs[s.request_id] = positions[first:first + emitted]


def target_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distributions the sampler draws from (temperature, top-k, top-p, min-p), normalised;
    `logits`: float32, after penalties and masks (`processed_logits`)."""
    if batch.all_greedy:
        return torch.softmax(logits, dim=-1)      # only the argmax is read
    logits = logits / batch.temperature
    if batch.top_k is not None or batch.top_p is not None:
        logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p, batch.max_top_k)
    probs = torch.softmax(logits, dim=-1)
    if batch.min_p is not None:
        probs = apply_min_p(probs, batch.min_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
