"""Sampler: logits [N, V] + SamplingBatch -> one token id per row (+ optional logprobs).

Order: penalties -> logit bias -> token masks (min_tokens bans, grammar bitmask) -> greedy argmax |
(temperature -> top-k -> top-p -> min-p -> sample).
Everything stays on the device; the only host reads are the caller's `.tolist()` calls.

Sampling uses the exponential race: argmax(probs / q) with q ~ Exp(1) i.i.d. picks token i with
probability probs[i], without a host sync (unlike torch.multinomial's checks). Unseeded rows share one batched draw; a row with its own generator draws
its own q of shape [V], so its token depends only on its logits and its generator, never on the
rest of the batch.

Logprobs, like vLLM's default, describe the raw model distribution: log_softmax of the logits
before penalties, temperature and masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenforge.core.outputs import PositionLogprobs
from tokenforge.executor.sampling_batch import LogitBias, PenaltyTensors, SamplingBatch, TokenMasks

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "SamplingBatch", "apply_min_p",
           "apply_logit_bias", "apply_penalties", "apply_token_masks", "apply_top_k_top_p", "compute_prompt_logprobs",
           "gather_logprobs", "processed_logits", "sampling_probs"]


@dataclass(slots=True)
class LogprobsTensors:
    """Row i: column 0 is the sampled token, columns 1..K the top-K tokens (K = max requested)."""

    token_ids: torch.Tensor     # [N, 1 + K] int64
    logprobs: torch.Tensor      # [N, 1 + K] float32
    sampled_rank: torch.Tensor  # [N] int64, 1-based rank of the sampled token
    num_logprobs: list[int | None]   # per row: how many top entries it asked for

    def to_position_logprobs(self) -> list[PositionLogprobs | None]:
        """One PositionLogprobs per row (None where the row asked for none); 3 host reads in all."""
        ids, lps, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.sampled_rank.tolist()
        out: list[PositionLogprobs | None] = []
        for row, k in enumerate(self.num_logprobs):
            if k is None:
                out.append(None)
                continue
            out.append(PositionLogprobs(ids[row][:k + 1], lps[row][:k + 1], [ranks[row], *range(1, k + 1)]))
        return out


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor               # [N] int64
    logprobs: LogprobsTensors | None      # None when no row asked for logprobs


class Sampler(torch.nn.Module):
    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if batch.argmax_only:
            # bf16 -> fp32 is exact, so the argmax of the raw logits is the same token: one launch.
            return SamplerOutput(logits.argmax(dim=-1), None)
        logits, raw_logprobs = processed_logits(logits, batch)
        if batch.all_greedy:
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._sample_random(logits, batch)
            if batch.greedy_mask is not None:
                token_ids = torch.where(batch.greedy_mask, logits.argmax(dim=-1), token_ids)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, token_ids, batch.max_num_logprobs, batch.num_logprobs)
        return SamplerOutput(token_ids, logprobs)

    @staticmethod
    def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        return sample_from_probs(sampling_probs(logits, batch), batch.generators, batch.generator_rows)


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[N, V] processed logits -> what a random row draws from: temperature, top-k, top-p, min-p
    (min-p's survivors not renormalised: the draw needs no sum)."""
    logits = logits / batch.temperature                                          # [N, V]
    if batch.top_k is not None or batch.top_p is not None:
        logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p, batch.max_top_k)
    probs = torch.softmax(logits, dim=-1)                                        # [N, V]
    if batch.min_p is not None:
        probs = apply_min_p(probs, batch.min_p)
    return probs


def processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [N, V] -> (float32 logits after penalties, logit bias and token masks, the raw log_softmax
    [N, V] when a row asked for logprobs, else None): what greedy takes the argmax of and
    temperature / top-k / top-p / min-p start from. Speculative verification uses it per draft row."""
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.max_num_logprobs is not None else None
    if batch.penalties is not None:
        logits = apply_penalties(logits, batch.penalties)
    if batch.logit_bias is not None:
        logits = apply_logit_bias(logits, batch.logit_bias)
    if batch.masks is not None:
        logits = apply_token_masks(logits, batch.masks)
    return logits, raw_logprobs


def apply_penalties(logits: torch.Tensor, pen: PenaltyTensors) -> torch.Tensor:
    """Repetition (HF: over prompt + output), then frequency/presence (OpenAI: over output)."""
    rows = logits if pen.rows is None else logits.index_select(0, pen.rows)  # [P, V]
    if pen.repetition is not None:
        scaled = torch.where(rows > 0, rows / pen.repetition, rows * pen.repetition)
        rows = torch.where(pen.seen_mask, scaled, rows)
    if pen.output_counts is not None:
        counts = pen.output_counts                                                # [P, V]
        rows = rows - pen.frequency * counts - pen.presence * (counts > 0).float()
    if pen.rows is None:
        return rows
    return logits.index_copy(0, pen.rows, rows)


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> torch.Tensor:
    """Add each row's biases to its logits (a row's token ids are distinct)."""
    return logits.index_put((bias.rows, bias.token_ids), bias.values, accumulate=True)


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks) -> torch.Tensor:
    """-inf for banned (row, token) pairs and for tokens a row's grammar does not allow."""
    if masks.banned_rows is not None:
        logits = logits.index_put((masks.banned_rows, masks.banned_ids),
                                  torch.full((), float("-inf"), device=logits.device))
    if masks.grammar_rows is not None:
        vocab = logits.shape[-1]
        shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
        bits = (masks.grammar_bitmask.unsqueeze(-1) >> shifts) & 1                  # [R, W, 32]
        allowed = bits.flatten(1)[:, :vocab].bool()                                  # [R, V]
        rows = logits.index_select(0, masks.grammar_rows).masked_fill(~allowed, float("-inf"))
        logits = logits.index_copy(0, masks.grammar_rows, rows)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      max_top_k: int = 0) -> torch.Tensor:
    """Set masked logits to -inf. top_k: [N, 1] (V = off); top_p: [N, 1] (1.0 = off).

    top-k keeps every token whose logit is >= the k-th largest, so ties at the boundary keep
    more than k. top-p keeps the shortest prefix of the (stable, descending) sort whose
    probability mass reaches top_p; among equal probabilities at the boundary, lower token ids
    come first. The most likely token always survives both.
    """
    vocab = logits.shape[-1]
    if top_p is None and 0 < max_top_k < vocab:
        # top-k alone: a partial topk is much cheaper than a full sort.
        kth = logits.topk(max_top_k, dim=-1).values.gather(-1, top_k.clamp(max=max_top_k) - 1)   # [N, 1]
        kth = torch.where(top_k >= vocab, float("-inf"), kth)
        return logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)     # [N, V]
    if top_k is not None:
        kth = sorted_logits.gather(-1, top_k - 1)                                 # [N, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs                         # exclusive cumsum
        # top_p == 1 keeps all: float rounding could otherwise drop the tail.
        drop = (mass_before >= top_p) & (top_p < 1.0)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero tokens with p < min_p * p_max (probs need not be renormalized after this)."""
    threshold = min_p * probs.amax(dim=-1, keepdim=True)                          # [N, 1]
    return probs.masked_fill(probs < threshold, 0.0)


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator],
                      generator_rows: torch.Tensor | None) -> torch.Tensor:
    """argmax(probs / q), q ~ Exp(1): a categorical draw, with per-row generators where given.

    q = -log(u) with u ~ U[0, 1): u < 1 keeps q > 0, so masked tokens (p = 0) score 0, never
    NaN. (torch.rand is also several times faster than exponential_ on the CPU.)
    """
    u = torch.rand(probs.shape, device=probs.device)                              # [N, V]
    if generators:
        vocab = probs.shape[-1]
        # Fresh [V] draws: a row's noise must not depend on where it sits in the batch.
        own = [torch.rand(vocab, device=probs.device, generator=g) for g in generators]
        u.index_copy_(0, generator_rows, torch.stack(own))
    return (probs / u.log_().neg_()).argmax(dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int,
                    num_logprobs: list[int | None]) -> LogprobsTensors:
    """logprobs: [N, V] (already log_softmax-ed); token_ids: [N]."""
    chosen = logprobs.gather(-1, token_ids.unsqueeze(-1))                         # [N, 1]
    rank = (logprobs > chosen).sum(dim=-1) + 1                                    # [N]
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)                                # [N, k]
        ids = torch.cat([token_ids.unsqueeze(-1), top_ids], dim=-1)
        lps = torch.cat([chosen, top_lp], dim=-1)
    else:
        ids, lps = token_ids.unsqueeze(-1), chosen
    return LogprobsTensors(ids, lps, rank, num_logprobs)


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, k: int) -> list[PositionLogprobs]:
    """logits: [T, V] predicting target_ids: [T]. Per position: the target, then the top-k."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)                          # [T, V]
    out = gather_logprobs(logprobs, target_ids.long(), k, [k] * logits.shape[0])
    return out.to_position_logprobs()
