"""GPTQ rounding for int4 groups: the codes that minimise the layer's output error on calibration
activations, not the weight error (Frantar et al., "GPTQ", 2022; written for tokenforge).

In: weights W [B, N, K] (B layers of one shape, batched so the column loop runs once for all of
them), the Hessians H = sum over calibration tokens of x x^T [B, K, K] of their inputs, the group
size. Out: per layer the same (packed codes, scales, zeros) as int4.quantize_int4_groups, so the
int4 method, its kernels and the compressed-tensors export take them unchanged.

The columns are quantized left to right. Each column's rounding error e is spread over the
columns not yet quantized, weighted by the inverse Hessian (w_j -= e * U[i, j] / U[i, i], U the
upper Cholesky factor of H^-1), so later columns compensate for it on the inputs correlated with
it. Columns go in blocks (a multiple of the group, about `BLOCK`); the update of the columns
after a block is one batched matrix product. A group's scale and zero are set when its first
column is reached, from its columns as they stand then (after the feedback of the groups before
it): min-max as round-to-nearest sets them, with the range shrunk by the ratio of CLIP_RATIOS
whose H-diagonal-weighted error is smallest (`search_clip`).

`act_order`: columns are visited by decreasing H diagonal (the inputs with the most energy first)
while each group keeps its contiguous columns, with parameters computed before any feedback (the
"static groups" variant), so the stored format stays plain groups.
"""

from __future__ import annotations

import contextlib

import torch

from tokenforge.kernels.quant_gemv import pack_int4

BLOCK = 128
# Added to H's diagonal, as a multiple of its mean: far more than GPTQ's usual 0.01. A few
# thousand calibration tokens against K up to 1536 inputs make the raw Hessian overfit: on the
# bundled model (first 2,048 tokens of GFDL-1.3, calibrated on the built-in text, int4 g64)
# perplexity was float 21.15, round-to-nearest 27.70, damping 0.01: 30.30, 0.1: 28.43, 0.3: 27.29,
# 1: 26.85, 3: 26.15, 10: 25.01, 100: 25.66 (at 10: no clip search 26.15, act_order 26.04).
DAMP = 10.0
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8)


def group_params(wg: torch.Tensor, hdiag: torch.Tensor | None, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., G] -> (scale [...], zero [...]): min-max (scale rounded to dtype, zero to an integer)
    and, with `hdiag` [..., G] (H's diagonal, broadcast over the rows), the clip ratio whose
    sum_j H_jj (w_j - dq_j)^2 is smallest."""
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    best = None
    for r in CLIP_RATIOS if hdiag is not None else (1.0,):
        scale = ((hi - lo) * r / 15.0).clamp_min(1e-8).to(dtype).float()
        zero = (-lo * r / scale).round().clamp(0, 15)
        if hdiag is None:
            return scale, zero
        q = (wg / scale[..., None]).round().add_(zero[..., None]).clamp_(0, 15)
        err = ((q - zero[..., None]) * scale[..., None] - wg).square_().mul_(hdiag).sum(dim=-1)
        if best is None:
            best = [err, scale, zero]
        else:
            better = err < best[0]
            best = [torch.where(better, new, old) for new, old in zip((err, scale, zero), best)]
    return best[1], best[2]


def _inverse_factor(h: torch.Tensor, w: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factors of (H + damp * mean diag)^-1 [B, K, K]; an input never seen (H_jj = 0)
    gets weight 0 in w (in place)."""
    h = h.double().clone()
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    dead = diag == 0
    diag[dead] = 1.0
    w.masked_fill_(dead[:, None, :], 0.0)
    eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)
    for attempt in range(5):            # more damping where rounding left it not positive definite
        jitter = damp * (10 ** attempt) * diag.mean(dim=-1)
        lower, info = torch.linalg.cholesky_ex(h + jitter[:, None, None] * eye)
        if not info.any():
            return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True).float()
    raise ValueError("GPTQ: a calibration Hessian is not positive definite even with damping")


@contextlib.contextmanager
def _one_cpu_thread(device: torch.device):
    """GPTQ is thousands of small elementwise steps (one per column): on the CPU intra-op threads
    cost more than they give there (10 qkv-sized layers: 1.3 s on one thread, 15-23 s on two of a
    loaded 2-core host), so it runs on one."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def gptq_int4_groups(w: torch.Tensor, h: torch.Tensor, group: int, dtype: torch.dtype, damp: float = DAMP,
                     act_order: bool = False, search_clip: bool = True
                     ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """W [B, N, K] (or [N, K]), H [B, K, K] (or [K, K]) -> per layer (uint8 [N, K/2], scale [N, K/G],
    zero [N, K/G]), scales in dtype."""
    with _one_cpu_thread(w.device):
        return _gptq(w[None] if w.dim() == 2 else w, h[None] if h.dim() == 2 else h, group, dtype, damp, act_order,
                     search_clip)


def _gptq(w: torch.Tensor, h: torch.Tensor, group: int, dtype: torch.dtype, damp: float, act_order: bool,
          search_clip: bool) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    b, n, k = w.shape
    w = w.detach().float().clone()
    h = h.to(w.device).float()
    hdiag = torch.diagonal(h, dim1=-2, dim2=-1).clone()              # [B, K]
    groups = k // group
    scales, zeros = torch.empty(b, n, groups, device=w.device), torch.empty(b, n, groups, device=w.device)
    clip_h = (lambda cols: hdiag[:, None, cols]) if search_clip else (lambda cols: None)
    order = None
    if act_order:                                       # static groups: parameters before any feedback
        for g in range(groups):
            cols = slice(g * group, (g + 1) * group)
            scales[..., g], zeros[..., g] = group_params(w[..., cols], clip_h(cols), dtype)
        order = torch.argsort(hdiag, dim=-1, descending=True)       # [B, K]
        w = torch.gather(w, 2, order[:, None, :].expand(b, n, k))
        h = torch.gather(torch.gather(h, 1, order[:, :, None].expand(b, k, k)), 2, order[:, None, :].expand(b, k, k))
        group_of = (order // group)[:, None, :].expand(b, n, k)     # column (visit order) -> its group
    u = _inverse_factor(h, w, damp)
    q = torch.empty(b, n, k, device=w.device)
    block = group * max(1, BLOCK // group)              # a group never straddles two blocks
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb, ub = w[..., b0:b1].clone(), u[:, b0:b1, b0:b1]
        errs = torch.empty_like(wb)
        for i in range(b1 - b0):
            col = b0 + i
            if order is None:
                if col % group == 0:
                    g = col // group
                    scales[..., g], zeros[..., g] = group_params(wb[..., i:i + group],
                                                                 clip_h(slice(col, col + group)), dtype)
                s, z = scales[..., col // group], zeros[..., col // group]
            else:
                idx = group_of[..., col:col + 1]
                s, z = scales.gather(2, idx)[..., 0], zeros.gather(2, idx)[..., 0]
            x = wb[..., i]
            qc = (x / s).round_().add_(z).clamp_(0, 15)
            q[..., col] = qc
            err = (x - (qc - z) * s) / ub[:, i, i][:, None]
            wb[..., i:] -= err[..., None] * ub[:, None, i, i:]
            errs[..., i] = err
        if b1 < k:
            w[..., b1:] -= torch.bmm(errs, u[:, b0:b1, b1:])
    if order is not None:
        q = torch.gather(q, 2, torch.argsort(order, dim=-1)[:, None, :].expand(b, n, k))
    codes = q.to(torch.uint8)
    return [(pack_int4(codes[i]), scales[i].to(dtype), zeros[i].to(dtype)) for i in range(b)]


__all__ = ["gptq_int4_groups", "group_params"]
