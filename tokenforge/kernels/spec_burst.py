"""The device steps of an n-gram burst iteration (executor/spec/burst.py), one launch each.

A burst iteration around the model's forward: `ngram_propose` (the n-gram lookup over the history),
`prepare_rows` (the K + 1 decode rows' ids, positions and attention metadata written into the CUDA
graphs' inputs), then after the LM head's argmax `accept_update` (the greedy verify, the emitted
tokens appended to the history and the burst's output, the counters advanced). The same steps as
~85 torch ops cost ~170 us an iteration on an H100 in launches alone; each kernel here is one
program, so an iteration adds four launches (with the argmax) to the model's.

State, all device tensors: hist [capacity + K + 1] int64 (the history, then scratch); state [3]
int64 = (length: tokens known, iteration, live: 0 while capturing, when the KV store must write
nowhere); counts [1 + 2 * steps] int64 = (emitted, then (drafts found, accepted) per iteration);
limits [2 + stops] int64 = (the tokens the request may still emit, the draft slots its KV holds,
then its stop ids, -1 padded); go [] bool: whether another iteration may run, which `accept_update`
clears once the burst emitted a stop id or its token budget, or the next iteration's K + 1 rows
would pass the slots (the CUDA graph's conditional nodes skip the iterations after that).
Each function has a torch reference (`*_ref`) with the same effect, used without Triton (the CPU)
and by the tests.
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, _interpreting, next_power_of_2, tl, triton

CONTEXT = 8     # executor/spec/ngram.py's CONTEXT: the tie-break's window (a power of 2 for the kernel)

# ---- torch references -------------------------------------------------------------------------


def _match_runs_ref(hist: torch.Tensor, end: torch.Tensor, sources: torch.Tensor, ngram_max: int) -> torch.Tensor:
    """Per source s [capacity]: how many tokens (<= ngram_max) of hist[..end] equal hist[..s], backwards."""
    t = torch.arange(ngram_max, device=hist.device)
    back = sources[None, :] - t[:, None]                               # [t, s]
    suffix = hist[(end - t).clamp(min=0)]
    match = (hist[back.clamp(min=0)] == suffix[:, None]) & (back >= 0)
    return match.to(torch.int32).cumprod(0).sum(0)


def ngram_propose_ref(hist: torch.Tensor, state: torch.Tensor, drafts: torch.Tensor, found: torch.Tensor,
                      ngram_min: int, ngram_max: int, capacity: int, resync: bool = False) -> None:
    """drafts [K] <- executor/spec/ngram.py's rule over hist[:length]: the tokens after the source c
    of the longest match of n = ngram_max..ngram_min tokens ending at the last one (resync: if there
    is none, ending at the one before it, the last token having replaced hist[c]), the one whose
    CONTEXT tokens share the most with the history's last ones, then the latest; found [1] <- how
    many of them are real (0: none)."""
    k, device = drafts.shape[0], hist.device
    length = state[0:1]
    c = torch.arange(capacity, device=device)
    valid = c <= length - 2                                             # a token follows c
    runs = torch.where(valid, _match_runs_ref(hist, length - 1, c, ngram_max), 0)
    if resync:
        shifted = torch.where(valid, _match_runs_ref(hist, length - 2, c - 1, ngram_max), 0)
        runs = torch.where(runs.amax() >= ngram_min, runs, shifted)
    best = runs.amax()
    j = torch.arange(CONTEXT, device=device)
    back = c[None, :] - j[:, None]                                      # [CONTEXT, c]
    window = torch.where(back >= 0, hist[back.clamp(min=0)], -1)
    tail = torch.where(length - 1 - j >= 0, hist[(length - 1 - j).clamp(min=0)], -2)
    overlap = (window[None, :, :] == tail[:, None, None]).any(1).sum(0)
    score = torch.where(valid & (runs == best) & (best >= ngram_min), overlap * capacity + c, -1)
    top = score.amax().view(1)
    start = top % capacity + 1
    found.copy_(torch.where(top >= 0, torch.minimum(length - start, torch.full_like(start, k)), 0))
    drafts.copy_(hist[(start + torch.arange(k, device=device)).clamp(max=capacity - 1)])


def prepare_rows_ref(hist: torch.Tensor, state: torch.Tensor, drafts: torch.Tensor, block_table: torch.Tensor,
                     block_size: int, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     seq_lens: torch.Tensor, context_lens: torch.Tensor) -> None:
    """Rows j = 0..K: the last known token then the drafts, at positions length - 1 + j, each a
    decode whose context is the tokens before it (slot -1 while not live)."""
    length = state[0:1]
    pos = length - 1 + torch.arange(drafts.shape[0] + 1, device=hist.device)
    ids.copy_(torch.cat([hist[length - 1], drafts]))
    positions.copy_(pos)
    slot = block_table[pos // block_size].long() * block_size + pos % block_size
    slots.copy_(torch.where(state[2] > 0, slot, -1))
    seq_lens.copy_(pos + 1)
    context_lens.copy_(pos)


def accept_update_ref(pred: torch.Tensor, drafts: torch.Tensor, found: torch.Tensor, state: torch.Tensor,
                      counts: torch.Tensor, hist: torch.Tensor, out: torch.Tensor, limits: torch.Tensor,
                      go: torch.Tensor) -> None:
    """pred [K + 1] (the target's argmax per row): accept the drafts while they equal it (those
    before max_tokens: found is capped by the budget left), append the accepted ones and the next
    token to hist and out, record (found, accepted), advance, and say in `go` whether another
    iteration may run (no stop id emitted, budget and slots left)."""
    k1 = pred.shape[0]
    rows = torch.arange(k1, device=pred.device)
    length, emitted = state[0:1], counts[0:1]
    found = torch.minimum(found, (limits[0:1] - emitted - 1).clamp(min=0))    # no draft past max_tokens
    accepted = ((pred[:-1] == drafts) & (rows[:-1] < found)).to(torch.int32).cumprod(0).sum()
    keep = rows <= accepted
    hist.index_copy_(0, torch.where(keep, length + rows, hist.shape[0] - k1 + rows), pred)
    out.index_copy_(0, torch.where(keep, emitted + rows, out.shape[0] - k1 + rows), pred)
    counts.index_copy_(0, 1 + 2 * state[1:2] + rows[:2], torch.cat([found.view(1), accepted.view(1)]))
    stopped = (keep[:, None] & (pred[:, None] == limits[None, 2:])).any()
    emitted += accepted + 1
    state[:2] += torch.stack([accepted + 1, torch.ones_like(accepted)])
    more = (emitted[0] < limits[0]) & (emitted[0] + (k1 - 1) <= limits[1])
    go.copy_(more & ~stopped)


# ---- kernels ----------------------------------------------------------------------------------


@triton.jit
def _runs_block(hist_ptr, end, src, valid, NGRAM_MAX: tl.constexpr):
    """Per lane: how many tokens (<= NGRAM_MAX) of hist[..end] equal hist[..src], backwards."""
    run = valid
    runs = tl.zeros_like(src)
    for t in tl.static_range(NGRAM_MAX):
        back = src - t
        ok = run & (back >= 0)
        tok = tl.load(hist_ptr + back, mask=ok, other=-1)
        suf = tl.load(hist_ptr + tl.maximum(end - t, 0))
        run = ok & (tok == suf)
        runs += run.to(tl.int64)
    return runs


@triton.jit
def _ngram_kernel(hist_ptr, state_ptr, drafts_ptr, found_ptr, capacity,
                  NGRAM_MIN: tl.constexpr, NGRAM_MAX: tl.constexpr, CONTEXT: tl.constexpr, RESYNC: tl.constexpr,
                  K: tl.constexpr, K_P: tl.constexpr, BLOCK: tl.constexpr):
    length = tl.load(state_ptr)
    offs = tl.arange(0, BLOCK)
    j = tl.arange(0, CONTEXT)
    # the best (run, overlap, c) as one key, (run * (CONTEXT + 1) + overlap) * capacity + c: exact
    # matches, and (RESYNC) matches ending one token earlier
    best_exact = tl.full([], -1, tl.int64)
    best_shift = tl.full([], -1, tl.int64)
    for start in range(0, length - 1, BLOCK):          # sources c <= length - 2
        c = (start + offs).to(tl.int64)
        valid = c <= length - 2
        back = c[None, :] - j[:, None]                  # [CONTEXT, BLOCK]
        window = tl.load(hist_ptr + back, mask=valid[None, :] & (back >= 0), other=-1)
        overlap = tl.zeros([BLOCK], tl.int64)
        for i in tl.static_range(CONTEXT):
            tail = tl.load(hist_ptr + tl.maximum(length - 1 - i, 0))
            tail = tl.where(length - 1 - i >= 0, tail, -2)
            overlap += tl.max((window == tail).to(tl.int64), axis=0)
        runs = _runs_block(hist_ptr, length - 1, c, valid, NGRAM_MAX)
        key = (runs * (CONTEXT + 1) + overlap) * capacity + c
        best_exact = tl.maximum(best_exact, tl.max(tl.where(valid & (runs >= NGRAM_MIN), key, -1), axis=0))
        if RESYNC:
            runs = _runs_block(hist_ptr, length - 2, c - 1, valid, NGRAM_MAX)
            key = (runs * (CONTEXT + 1) + overlap) * capacity + c
            best_shift = tl.maximum(best_shift, tl.max(tl.where(valid & (runs >= NGRAM_MIN), key, -1), axis=0))
    top = tl.where(best_exact >= 0, best_exact, best_shift)
    first = top % capacity + 1
    count = tl.where(top >= 0, tl.minimum(length - first, K), 0)
    ks = tl.arange(0, K_P)
    d = tl.load(hist_ptr + tl.minimum(first + ks, capacity - 1), mask=ks < K, other=0)
    tl.store(drafts_ptr + ks, d, mask=ks < K)
    tl.store(found_ptr, count)


@triton.jit
def _prepare_kernel(hist_ptr, state_ptr, drafts_ptr, table_ptr, block_size, ids_ptr, pos_ptr, slot_ptr,
                    seq_ptr, ctx_ptr, K: tl.constexpr, K1_P: tl.constexpr):
    length = tl.load(state_ptr)
    live = tl.load(state_ptr + 2)
    r = tl.arange(0, K1_P)
    rows = r < K + 1
    d = tl.load(drafts_ptr + tl.maximum(r - 1, 0), mask=rows & (r >= 1), other=0)
    last = tl.load(hist_ptr + length - 1)
    pos = length - 1 + r
    block = tl.load(table_ptr + pos // block_size, mask=rows, other=0).to(tl.int64)
    slot = tl.where(live > 0, block * block_size + pos % block_size, -1)
    tl.store(ids_ptr + r, tl.where(r == 0, last, d), mask=rows)
    tl.store(pos_ptr + r, pos, mask=rows)
    tl.store(slot_ptr + r, slot.to(tl.int32), mask=rows)
    tl.store(seq_ptr + r, (pos + 1).to(tl.int32), mask=rows)
    tl.store(ctx_ptr + r, pos.to(tl.int32), mask=rows)


@triton.jit
def _accept_kernel(pred_ptr, drafts_ptr, found_ptr, state_ptr, counts_ptr, hist_ptr, out_ptr, limits_ptr, go_ptr,
                   K: tl.constexpr, K1_P: tl.constexpr, STOPS: tl.constexpr):
    r = tl.arange(0, K1_P)
    rows = r < K + 1
    pred = tl.load(pred_ptr + r, mask=rows, other=0)
    d = tl.load(drafts_ptr + r, mask=r < K, other=-1)
    length = tl.load(state_ptr)
    it = tl.load(state_ptr + 1)
    emitted = tl.load(counts_ptr)
    found = tl.minimum(tl.load(found_ptr), tl.maximum(tl.load(limits_ptr) - emitted - 1, 0))   # none past max_tokens
    match = (pred == d) & (r < found) & (r < K)
    accepted = tl.min(tl.where(match, K1_P, r), axis=0)      # the first row that does not match
    accepted = tl.minimum(accepted, K)
    keep = rows & (r <= accepted)
    tl.store(hist_ptr + length + r, pred, mask=keep)
    tl.store(out_ptr + emitted + r, pred, mask=keep)
    stops = tl.load(limits_ptr + 2 + tl.arange(0, STOPS))
    hit = keep[:, None] & (pred[:, None] == stops[None, :])
    stopped = tl.max(tl.max(hit.to(tl.int32), axis=1), axis=0)
    now = emitted + accepted + 1
    more = (now < tl.load(limits_ptr)) & (now + K <= tl.load(limits_ptr + 1)) & (stopped == 0)
    tl.debug_barrier()                  # every thread has read the counters before any is advanced
    tl.store(counts_ptr + 1 + 2 * it, found)
    tl.store(counts_ptr + 2 + 2 * it, accepted.to(tl.int64))
    tl.store(counts_ptr, now)
    tl.store(state_ptr, length + accepted + 1)
    tl.store(state_ptr + 1, it + 1)
    tl.store(go_ptr, more)


# ---- launch -----------------------------------------------------------------------------------


def use_kernels(device: torch.device) -> bool:
    """The kernels on a GPU (and under Triton's interpreter, for the tests); the references elsewhere."""
    return HAS_TRITON and (device.type == "cuda" or _interpreting())


def ngram_propose(hist, state, drafts, found, ngram_min: int, ngram_max: int, capacity: int,
                  resync: bool = False) -> None:
    if not use_kernels(hist.device):
        return ngram_propose_ref(hist, state, drafts, found, ngram_min, ngram_max, capacity, resync)
    k = drafts.shape[0]
    _ngram_kernel[(1,)](hist, state, drafts, found, capacity, NGRAM_MIN=ngram_min, NGRAM_MAX=ngram_max,
                        CONTEXT=CONTEXT, RESYNC=resync, K=k, K_P=next_power_of_2(k), BLOCK=512, num_warps=4)


def prepare_rows(hist, state, drafts, block_table, block_size: int, ids, positions, slots, seq_lens,
                 context_lens) -> None:
    if not use_kernels(hist.device):
        return prepare_rows_ref(hist, state, drafts, block_table, block_size, ids, positions, slots, seq_lens,
                                context_lens)
    k = drafts.shape[0]
    _prepare_kernel[(1,)](hist, state, drafts, block_table, block_size, ids, positions, slots, seq_lens,
                          context_lens, K=k, K1_P=next_power_of_2(k + 1), num_warps=1)


def accept_update(pred, drafts, found, state, counts, hist, out, limits, go) -> None:
    if not use_kernels(pred.device):
        return accept_update_ref(pred, drafts, found, state, counts, hist, out, limits, go)
    k, stops = drafts.shape[0], limits.shape[0] - 2
    assert stops == next_power_of_2(stops), "limits: 2 + a power-of-two count of stop ids"
    _accept_kernel[(1,)](pred, drafts, found, state, counts, hist, out, limits, go, K=k,
                         K1_P=next_power_of_2(k + 1), STOPS=stops, num_warps=1)
