"""The top-k routing of router-logit rows inside a Triton program, shared by `route_align`
(kernels/moe_routing.py: every row of a decode batch in one program; kernels/moe_route_wide.py:
a block of a larger batch's rows a program) and the routed per-pair GEMVs (kernels/moe_gemv.py: each program routes its own token's row), so both select the same
experts with the same weights: the k largest (probabilities for softmax-then-top-k, logits for
top-k-then-softmax), the lowest index first on a tie, as torch's topk on these inputs does.
"""

from __future__ import annotations

from ._triton import tl, triton


@triton.jit
def route_rows(logits_ptr, rows, T, E, stride_lt, K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
               SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr):
    """Logit rows `rows` ([T_PAD] int, rows >= T masked) -> (routing weights [T_PAD, K_PAD] fp32,
    global expert ids [T_PAD, K_PAD] int32, the live slots [1, K_PAD]: kk < K)."""
    cols = tl.arange(0, E_PAD)
    live = (rows < T)[:, None] & (cols < E)[None, :]
    s = tl.load(logits_ptr + rows[:, None] * stride_lt + cols[None, :], mask=live, other=float("-inf"))
    s = s.to(tl.float32)
    if SOFTMAX_FIRST:                     # select on the probabilities, as torch does
        row_max = tl.max(s, 1)
        p = tl.where(live, tl.exp(s - tl.where(rows < T, row_max, 0.0)[:, None]), 0.0)
        s = tl.where(live, p / tl.maximum(tl.sum(p, 1), 1e-30)[:, None], -1.0)
    kk = tl.arange(0, K_PAD)
    top = tl.zeros((rows.shape[0], K_PAD), dtype=tl.float32)
    sel = tl.zeros((rows.shape[0], K_PAD), dtype=tl.int32)
    for j in tl.static_range(K):          # the k largest, the lowest index first on a tie
        best = tl.max(s, 1)
        idx = tl.min(tl.where(s == best[:, None], cols[None, :], E_PAD), 1)
        top = tl.where(kk[None, :] == j, best[:, None], top)
        sel = tl.where(kk[None, :] == j, idx[:, None], sel)
        s = tl.where(cols[None, :] == idx[:, None], float("-inf"), s)
    chosen = kk[None, :] < K
    if SOFTMAX_FIRST:
        w = tl.where(chosen, top, 0.0)
        if RENORMALIZE:
            w = w / tl.maximum(tl.sum(w, 1), 1e-30)[:, None]
    else:                                 # a softmax over the k chosen logits
        top_max = tl.where(rows < T, tl.max(tl.where(chosen, top, float("-inf")), 1), 0.0)
        e = tl.where(chosen, tl.exp(top - top_max[:, None]), 0.0)
        w = e / tl.maximum(tl.sum(e, 1), 1e-30)[:, None]
    return w, sel, chosen


@triton.jit
def route_and_store(logits_ptr, weights_ptr, ids_ptr, rows, T, E, first, num_local, stride_lt, K: tl.constexpr,
                    E_PAD: tl.constexpr, K_PAD: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr):
    """`route_rows` for `rows`, stored: routing weights [T, K] fp32 and this rank's expert ids [T, K]
    int64 (experts before `first` or past `num_local` -> the sentinel num_local). Returns (the local
    ids [T_PAD, K_PAD], the stored slots [T_PAD, K_PAD])."""
    w, sel, chosen = route_rows(logits_ptr, rows, T, E, stride_lt, K, E_PAD, K_PAD, SOFTMAX_FIRST, RENORMALIZE)
    out = (rows < T)[:, None] & chosen
    offs = rows[:, None] * K + tl.arange(0, K_PAD)[None, :]
    tl.store(weights_ptr + offs, w, mask=out)
    local = sel - first
    local = tl.where((local >= 0) & (local < num_local), local, num_local)
    tl.store(ids_ptr + offs, local.to(tl.int64), mask=out)
    return local, out
