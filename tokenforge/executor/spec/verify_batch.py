"""The sampling state of a verify step's rows: each drafted sequence's k + 1 rows are sampled as
decode rows whose history is the tokens before them.

A sequence verified with drafts d_1..d_d takes rows j = 0..k of the LM head; row j predicts the
token after d_j (row 0: after its last known token t). Row j is sampled as a decode of the
sequence would be once d_1..d_j were emitted:
- penalties count d_1..d_j as output (added on the device, where a draft model's drafts are);
- its grammar mask is the matcher's state after d_1..d_j (the engine computes one mask per
  sampling position, `GrammarMatchers.fill`; `split_grammar_rows` maps them to rows here);
- EOS and stop ids are banned while its output index is before min_tokens (`banned_rows`);
- its logprobs are the raw distribution's at the token it emits (the accepted draft or the
  corrected / bonus token), as the sampler gives them for a decode.
Rows past d + 1 repeat row d's hidden state; nothing they give is read.

`grammar_rows` of a step index its sampling positions: each sequence that samples has
1 + num_draft_tokens of them, in order (without drafts: one per sequence, the sampler's rows).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tokenforge.executor.sampling_batch import PenaltyTensors, SamplingBatch


@dataclass(slots=True)
class GrammarSplit:
    """A step's grammar rows split between the plain sampler's rows and the verify rows; each
    with the rows of the step's bitmask (one per sampling position) that belong to them."""

    plain_rows: list[int]
    plain_masks: list[int]
    verify_rows: list[int]
    verify_masks: list[int]


def split_grammar_rows(sampling: list, grammar_rows: list[int], k: int) -> GrammarSplit:
    """`sampling`: the step's sequences that sample, in order; `k`: the verify's rows per drafted
    sequence less one. Maps each sampling position in `grammar_rows` to its row."""
    where: list[tuple[bool, int]] = []          # per sampling position: (a verify row, the row)
    plain = drafted = 0
    for s in sampling:
        d = s.num_draft_tokens
        if d:
            where.extend((True, drafted * (k + 1) + j) for j in range(d + 1))
            drafted += 1
        else:
            where.append((False, plain))
            plain += 1
    split = GrammarSplit([], [], [], [])
    for mask, position in enumerate(grammar_rows):
        is_verify, row = where[position]
        (split.verify_rows if is_verify else split.plain_rows).append(row)
        (split.verify_masks if is_verify else split.plain_masks).append(mask)
    return split


def select_masks(bitmask, rows: list[int]):
    """The bitmask rows listed (the whole array when that is all of them; None when none)."""
    if not rows:
        return None
    if len(rows) == bitmask.shape[0]:        # increasing and distinct: all of them
        return bitmask
    return bitmask[rows]


def verify_sampling_batch(seqs: list, drafts: torch.Tensor, k: int, vocab_size: int, device: torch.device,
                          grammar_rows: list[int] | None = None, grammar_bitmask=None,
                          generators: list | None = None) -> SamplingBatch | None:
    """The SamplingBatch of the verify rows [len(seqs) * (k + 1)]: each sequence's params and
    history repeated per row, its drafts before each row added to the penalties' history.
    `drafts` [N, k]: the draft ids on the device (past a sequence's own count: any id).
    `generators`: per sequence, its own generator (seeded requests) or None; its rows 0..d draw
    from it in row order, the padding rows after them do not (they draw nothing the request keeps).
    None when every row takes the raw argmax (the common case: checked per sequence, no build)."""
    if not grammar_rows and all(_takes_raw_argmax(s) for s in seqs):
        return None
    rows = k + 1
    params = [s.params for s in seqs for _ in range(rows)]
    prompts = [s.prompt_token_ids for s in seqs for _ in range(rows)]
    outputs = [s.output_token_ids for s in seqs for _ in range(rows)]
    banned = [s.banned_token_ids if j < s.banned_rows else () for s in seqs for j in range(rows)]
    gens = generators or [None] * len(seqs)
    row_gens = [g if j <= s.num_draft_tokens else None for s, g in zip(seqs, gens) for j in range(rows)]
    batch = SamplingBatch.build(params, prompts, outputs, row_gens, vocab_size, device, banned=banned,
                                grammar_rows=grammar_rows, grammar_bitmask=grammar_bitmask)
    if batch.penalties is not None:
        batch.penalties = add_draft_history(batch.penalties, drafts, k)
    return batch


def _takes_raw_argmax(seq) -> bool:
    """Greedy, with no penalty, logit bias, logprobs or banned ids (grammar masks are the step's)."""
    p = seq.params
    return p.is_greedy and p.logprobs is None and not seq.banned_token_ids and not p.shapes_logits


def add_draft_history(pen: PenaltyTensors, drafts: torch.Tensor, k: int) -> PenaltyTensors:
    """Penalties over verify rows [N * (k + 1)]: row j of a sequence also counts its drafts
    d_1..d_j as output (frequency / presence counts, and the repetition penalty's seen tokens)."""
    counts = pen.output_counts if pen.output_counts is not None else pen.seen_mask
    num_rows, vocab = counts.shape
    rows = pen.rows if pen.rows is not None else torch.arange(num_rows, device=drafts.device)
    seq, j = rows // (k + 1), rows % (k + 1)                                            # [P]
    before = (torch.arange(k, device=drafts.device)[None, :] < j[:, None]).float()    # [P, k]
    extra = torch.zeros(num_rows, vocab, device=drafts.device).scatter_add_(1, drafts[seq], before)   # [P, V]
    return replace(pen, seen_mask=None if pen.seen_mask is None else pen.seen_mask | (extra > 0),
                   output_counts=None if pen.output_counts is None else pen.output_counts + extra)
