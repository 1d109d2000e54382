"""SamplingBatch: the per-step sampling parameters of N rows, as device tensors.

In: WireSamplingParams, prompt/output token ids and per-request torch.Generators, one per row.
Out: small [N] tensors (temperature, top-k, top-p, min-p), optional penalty tensors, and
host-side flags that let the sampler skip whole stages without reading the device.

Built every step for up to max_num_seqs rows, so it stays cheap: every scalar parameter
travels in one packed host->device copy (pinned, non-blocking: no host sync), stages nobody
uses get `None`, and penalty tensors cover only the rows that use penalties (and only read
prompt tokens for repetition penalty).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from tokenforge.core.outputs import WireSamplingParams

@dataclass(slots=True)
class PenaltyTensors:
    """Penalty inputs for the `rows` that use a penalty (all rows when `rows` is None)."""

    rows: torch.Tensor | None              # [P] int64 row indices into the batch
    repetition: torch.Tensor | None        # [P, 1] float; None when no row uses it
    seen_mask: torch.Tensor | None         # [P, V] bool: token in prompt or output
    frequency: torch.Tensor | None         # [P, 1] float; None when no row uses presence/frequency
    presence: torch.Tensor | None          # [P, 1] float
    output_counts: torch.Tensor | None     # [P, V] float: occurrences in the output


@dataclass(slots=True)
class LogitBias:
    """OpenAI's logit_bias: `values` added to the logits at (`rows`, `token_ids`), each [B]."""

    rows: torch.Tensor                     # [B] int64
    token_ids: torch.Tensor                # [B] int64
    values: torch.Tensor                   # [B] float32


@dataclass(slots=True)
class TokenMasks:
    """Tokens that must not be sampled this step, as device tensors (-inf before sampling)."""

    banned_rows: torch.Tensor | None       # [B] int64 row of each banned (row, token) pair
    banned_ids: torch.Tensor | None        # [B] int64 token ids (EOS/stop ids before min_tokens)
    grammar_rows: torch.Tensor | None      # [R] int64 constrained rows
    grammar_bitmask: torch.Tensor | None   # [R, ceil(V / 32)] int32: bit t of word w allows 32 * w + t


@dataclass(slots=True)
class SamplingBatch:
    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None       # [N] bool; None when all rows share one mode
    temperature: torch.Tensor | None       # [N, 1] float; greedy rows hold 1.0; None if all greedy
    top_k: torch.Tensor | None             # [N, 1] int64, disabled = vocab_size; None if unused
    top_p: torch.Tensor | None             # [N, 1] float, disabled = 1.0; None if unused
    min_p: torch.Tensor | None             # [N, 1] float, disabled = 0.0; None if unused
    max_top_k: int                         # largest enabled top-k (host int), 0 when unused
    penalties: PenaltyTensors | None
    generators: list[torch.Generator]      # one per seeded random row, in row order
    generator_rows: torch.Tensor | None    # [G] int64: the rows those generators belong to
    num_logprobs: list[int | None]         # per row: top-N requested, None = no logprobs
    max_num_logprobs: int | None           # None when no row asked for logprobs
    masks: TokenMasks | None = None        # min_tokens and grammar constraints; None when unused
    logit_bias: LogitBias | None = None    # None when no row has a bias

    @classmethod
    def build(cls, params: list[WireSamplingParams], prompt_ids: list[list[int]],
              output_ids: list[list[int]], generators: list[torch.Generator | None],
              vocab_size: int, device: torch.device | str, *, banned: list[tuple[int, ...]] | None = None,
              grammar_rows: list[int] | None = None, grammar_bitmask: np.ndarray | None = None) -> SamplingBatch:
        n = len(params)
        assert n == len(prompt_ids) == len(output_ids) == len(generators) and n > 0
        greedy = [p.is_greedy for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)
        # One packed [N, 5] host tensor -> one copy. Greedy rows get neutral values so that
        # only random rows decide which masking stages run.
        packed = [_row_values(p, g, vocab_size) for p, g in zip(params, greedy)]
        use_k = any(r[1] < vocab_size for r in packed)
        use_p = any(r[2] < 1.0 for r in packed)
        use_min_p = any(r[3] > 0.0 for r in packed)
        scalars = None
        if not all_greedy:
            scalars = upload(torch.tensor(packed, dtype=torch.float32), device)   # [N, 5]
        seeded = [i for i, g in enumerate(generators) if g is not None and not greedy[i]]
        num_logprobs = [p.logprobs for p in params]
        requested = [k for k in num_logprobs if k is not None]
        return cls(
            num_rows=n, vocab_size=vocab_size, all_greedy=all_greedy, all_random=all_random,
            greedy_mask=None if all_greedy or all_random else scalars[:, 4] > 0.5,
            temperature=None if scalars is None else scalars[:, 0:1],
            top_k=scalars[:, 1:2].long() if use_k else None,
            top_p=scalars[:, 2:3] if use_p else None,
            min_p=scalars[:, 3:4] if use_min_p else None,
            max_top_k=max((int(r[1]) for r in packed if r[1] < vocab_size), default=0),
            penalties=_build_penalties(params, prompt_ids, output_ids, vocab_size, device),
            generators=[generators[i] for i in seeded],
            generator_rows=upload(torch.tensor(seeded, dtype=torch.long), device) if seeded else None,
            num_logprobs=num_logprobs,
            max_num_logprobs=max(requested) if requested else None,
            masks=_build_masks(banned, grammar_rows, grammar_bitmask, device),
            logit_bias=_build_logit_bias(params, device),
        )

    @property
    def argmax_only(self) -> bool:
        """All greedy, with no penalties, bias, masks or logprobs: the raw logits' argmax is the answer."""
        return (self.all_greedy and self.penalties is None and self.max_num_logprobs is None
                and self.masks is None and self.logit_bias is None)

    @property
    def needs_masks(self) -> bool:
        return self.top_k is not None or self.top_p is not None or self.min_p is not None


def _build_masks(banned: list[tuple[int, ...]] | None, grammar_rows: list[int] | None,
                 grammar_bitmask: np.ndarray | None, device: torch.device | str) -> TokenMasks | None:
    pairs = [(row, t) for row, ids in enumerate(banned or ()) for t in ids]
    if not pairs and not grammar_rows:
        return None
    banned_rows = banned_ids = rows = bitmask = None
    if pairs:
        both = upload(torch.tensor(pairs, dtype=torch.long).T.contiguous(), device)        # [2, B]
        banned_rows, banned_ids = both[0], both[1]
    if grammar_rows:
        rows = upload(torch.tensor(grammar_rows, dtype=torch.long), device)
        # The engine fills the executor's pinned slot (grammar_bitmask_buffer): one async copy.
        bitmask = upload(torch.from_numpy(grammar_bitmask), device, pinned=True)
    return TokenMasks(banned_rows, banned_ids, rows, bitmask)


def _build_logit_bias(params: list[WireSamplingParams], device: torch.device | str) -> LogitBias | None:
    triples = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias]
    if not triples:
        return None
    ids = upload(torch.tensor([(row, t) for row, t, _ in triples], dtype=torch.long).T.contiguous(), device)  # [2, B]
    values = upload(torch.tensor([b for _, _, b in triples], dtype=torch.float32), device)
    return LogitBias(ids[0], ids[1], values)


def upload(cpu: torch.Tensor, device: torch.device | str, pinned: bool = False) -> torch.Tensor:
    """Host -> device without a host sync: a pinned staging copy (unless `pinned` says the
    memory may already be pinned), then a non-blocking copy."""
    device = torch.device(device)
    if device.type == "cpu":
        return cpu
    if device.type == "cuda" and not (pinned and cpu.is_pinned()):
        cpu = cpu.pin_memory()
    return cpu.to(device, non_blocking=True)


def _row_values(p: WireSamplingParams, greedy: bool, vocab_size: int) -> tuple[float, ...]:
    """(temperature, top_k, top_p, min_p, is_greedy); top-k <= 2**24 is exact in fp32."""
    if greedy:
        return (1.0, float(vocab_size), 1.0, 0.0, 1.0)
    top_k = vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size)
    return (p.temperature, float(top_k), p.top_p, p.min_p, 0.0)


def _build_penalties(params: list[WireSamplingParams], prompt_ids: list[list[int]],
                     output_ids: list[list[int]], vocab_size: int,
                     device: torch.device | str) -> PenaltyTensors | None:
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    freq_rows = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if not rep_rows and not freq_rows:
        return None
    rows = sorted(set(rep_rows) | set(freq_rows))
    counts = _count_tokens([output_ids[i] for i in rows], vocab_size, device)   # [P, V]
    seen = None
    if rep_rows:
        seen = counts > 0
        prompt_rows = [j for j, i in enumerate(rows) if params[i].repetition_penalty != 1.0]
        flat_rows, flat_ids = _flatten([prompt_ids[rows[j]] for j in prompt_rows], prompt_rows, device)
        # A device-side True: indexing with a Python bool would copy it with a host sync.
        seen.index_put_((flat_rows, flat_ids), torch.ones((), dtype=torch.bool, device=seen.device))

    values = [(params[i].repetition_penalty, params[i].frequency_penalty, params[i].presence_penalty)
              for i in rows]
    values = upload(torch.tensor(values, dtype=torch.float32), device)          # [P, 3]
    return PenaltyTensors(
        rows=None if len(rows) == len(params) else upload(torch.tensor(rows, dtype=torch.long), device),
        repetition=values[:, 0:1] if rep_rows else None,
        seen_mask=seen,
        frequency=values[:, 1:2] if freq_rows else None,
        presence=values[:, 2:3] if freq_rows else None,
        output_counts=counts if freq_rows else None,
    )


def _flatten(lists: list[list[int]], row_ids: list[int],
             device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index per token, token ids), both [sum(len)] int64, from ragged token lists.

    Built in numpy (several times faster than torch.tensor on long lists), one upload.
    """
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    flat = np.empty((2, int(lengths.sum())), dtype=np.int64)                   # [2, total]
    flat[0] = np.repeat(np.asarray(row_ids, dtype=np.int64), lengths)
    flat[1] = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in lists])
    both = upload(torch.from_numpy(flat), device)
    return both[0], both[1]


def _count_tokens(lists: list[list[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    counts = torch.zeros(len(lists), vocab_size, dtype=torch.float32, device=device)   # [P, V]
    flat_rows, flat_ids = _flatten(lists, list(range(len(lists))), device)
    counts.index_put_((flat_rows, flat_ids), torch.ones((), device=device).expand(flat_ids.numel()),
                      accumulate=True)
    return counts
