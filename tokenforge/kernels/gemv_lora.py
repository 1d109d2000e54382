"""One-row GEMV with the multi-LoRA delta: y = p(x) W^T + scale[s] B[s] (A[s] p(x)), two launches.

In: x [1, K] (or [1, 2K] = [gate | up] for the SiLU-and-mul prologue), W [N, K], optional bias
[N], and a `GemvLoRA` (one linear's slots, model/layers/lora.py): lora_A [S, n*R, K], lora_B
[S, N, R], scale [S] fp32, indices [1] (the row's slot, -1: none) and the packed slices' sizes.
p is one of gemv.py's prologues (none, add + RMSNorm, SiLU-and-mul), so a linear with an adapter
keeps its fused prologue. Out: y [1, N] (and the new residual for the norm prologue), as gemv.py
and then kernels/lora.py would give.

Why: at batch 1 the hook path costs each adapted linear a shrink and an expand launch (and the
fused prologue: a separate norm / SwiGLU launch), each about as dear as a small GEMV, for LoRA
weights under 1% of the step's bytes (BENCHMARKS.md, wave 3 round 4). Here the shrink's programs
sit in the GEMV's own grid (first, so the slot load's latency hides in the first wave), and a
one-row expand follows, launched under PDL: W1 with one rank-16 adapter on all seven projections
keeps 89.9% of bare on an H100 (BENCHMARKS.md, wave 3 round 9).

Measured and dropped:
- every program taking a ticket from one atomic counter before its first weight load, roles by
  ticket (round 7): W1 fell from 59.5% to 51.8% of bare (the loads waited for the ticket, and
  14,000 programs of gate_up queued on one address);
- one launch, the row programs waiting (acquire loads of a per-linear counter) for the shrink
  programs and adding the delta in their epilogue (round 8, measured in round 9): 8.80 ms a token
  against 7.60 for these two launches in the same process, the GEMV itself 29% slower;
- the expand launched without PDL (round 9): 7.87 against 7.43 ms a token.
Found in round 11 (tests/kernels/test_gemv_lora_codegen.py): with the programs' row pointers taken
from the two arms of a branch, the merge lost their alignment and every weight load was one bf16
(the bare GEMV: 16-byte loads), ~3 us a linear; the rows are now a select of both.

Deferred (`gemv_lora_deferred`): the GEMV launch alone, its delta left as a `LoRADelta` for the
kernel after to add as it loads y (kernels/lora_delta.py: the norm after o_proj, the SwiGLU after
gate_up), so the expand's launch and its place in the chain of dependent kernels go;
`add_lora_delta` is the expand for a consumer that cannot.

`gemv_lora_ref` is the torch computation (gemv.py's reference, then kernels/lora.py's).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._triton import next_power_of_2, require_triton, tl, triton, use_pdl
from .activation import silu_and_mul_ref
from .gemv import NORM, PLAIN, SILU_MUL, _fma, _row_rstd, _x_chunk, gemv_config
from .lora import lora_reference
from .lora_delta import LoRADelta
from .rms_norm import fused_add_rms_norm_ref, rms_norm_ref


class GemvLoRA(NamedTuple):
    """One linear's adapter slots as the fused GEMV reads them (see the module note)."""
    lora_a: torch.Tensor      # [S, n*R, K]
    lora_b: torch.Tensor      # [S, N, R]
    scale: torch.Tensor       # [S] fp32
    indices: torch.Tensor     # [1] int: the row's slot, -1 for none
    slices: tuple[int, ...]   # the packed outputs' sizes (sum N)
    in_gemm: object = None    # model/layers/lora.ShrinkInGemm when the slots' A sit under the weight


EXPAND_PDL = True             # the expand as a PDL dependent of its GEMV (bench/lora_diag.py varies it)


def gemv_lora_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora: GemvLoRA,
                  residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                  prologue: int = PLAIN) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prologue's output h, y = h W^T + b rounded to x's dtype, then the delta of h added."""
    new_residual = None
    if prologue == NORM and residual is None:
        h = rms_norm_ref(x, norm_weight, eps)
    elif prologue == NORM:
        h, new_residual = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
    else:
        h = silu_and_mul_ref(x) if prologue == SILU_MUL else x
    y = (h.float() @ weight.float().t() + (bias.float() if bias is not None else 0.0)).to(x.dtype).float()
    out = lora_reference(h.float(), y, lora.lora_a.float(), lora.lora_b.float(), lora.scale, lora.indices, lora.slices)
    return out.to(x.dtype), new_residual


@triton.jit
def _first_tile(row_ptrs, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    ks = tl.arange(0, BLOCK_K)
    if EVEN_K:
        return tl.load(row_ptrs[:, None] + ks[None, :], eviction_policy="evict_first")
    return tl.load(row_ptrs[:, None] + ks[None, :], mask=(ks < K)[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _dot_rows(w, row_ptrs, x_ptr, r_ptr, nw_ptr, K, rstd, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """p(x) . the rows at row_ptrs [BLOCK_N] (K contiguous) in fp32, given their first tile w
    (`_first_tile`), the next tile's loads in flight while one is multiplied."""
    ks = tl.arange(0, BLOCK_K)
    ms = tl.zeros([1], dtype=tl.int64)
    m_mask = ms < 1
    w_ptrs = row_ptrs[:, None] + ks[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            w_next = tl.load(w_ptrs + k0, eviction_policy="evict_first")
        else:
            w_next = tl.load(w_ptrs + k0, mask=(k0 + ks < K)[None, :], other=0.0, eviction_policy="evict_first")
        xk = _x_chunk(x_ptr, r_ptr, nw_ptr, ms, m_mask, k0 - BLOCK_K + ks, K, 0, 0, rstd, PROLOGUE, HAS_RESIDUAL)
        acc = _fma(acc, w, xk, 1)
        w = w_next
    last = (K - 1) // BLOCK_K * BLOCK_K
    xk = _x_chunk(x_ptr, r_ptr, nw_ptr, ms, m_mask, last + ks, K, 0, 0, rstd, PROLOGUE, HAS_RESIDUAL)
    acc = _fma(acc, w, xk, 1)
    return tl.sum(acc, axis=1)


@triton.jit
def _waited_rows(row_ptrs, x_ptr, r_ptr, s_ptr, nw_ptr, K, eps, write_sum, PROLOGUE: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr,
                 EVEN_K: tl.constexpr, USE_PDL: tl.constexpr):
    """A program's rows: their first tile issued before the PDL wait (weights never depend on the
    previous kernel), then the prologue's norm and p(x) . rows. Returns (y [BLOCK_N] fp32, rstd)."""
    w = _first_tile(row_ptrs, K, BLOCK_K, EVEN_K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    ms = tl.zeros([1], dtype=tl.int64)
    rstd = tl.zeros([1], dtype=tl.float32)
    if PROLOGUE == 1:
        rstd = _row_rstd(x_ptr, r_ptr, s_ptr, ms, ms < 1, K, 0, 0, 0, eps, write_sum, HAS_RESIDUAL, 1, NORM_BLOCK)
    y = _dot_rows(w, row_ptrs, x_ptr, r_ptr, nw_ptr, K, rstd, PROLOGUE, HAS_RESIDUAL, BLOCK_N, BLOCK_K, EVEN_K)
    return y, rstd


@triton.jit
def _gemv_shrink_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, s_ptr, a_ptr, idx_ptr, shrunk_ptr,
    N, K, stride_wn, stride_as, eps,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, PACKED_RANK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr, ONE_SLOT: tl.constexpr,
):
    """The first cdiv(PACKED_RANK, BLOCK_N) programs: shrunk[rows] = p(x) A[slot][rows]^T in fp32
    (slot -1 reads slot 0's rows; nobody adds them); the rest: gemv.py's, y[rows] = p(x) W[rows]^T
    (+ b). The shrink programs come first: their rows' address waits for the slot's load, a latency
    the first wave hides and the last wave would add to the kernel's end (wave 3 round 9: ~2 us a
    linear with them last). With ONE_SLOT (--max-loras 1) their rows are slot 0's, with no wait for
    the index (a row without an adapter computes them too; nobody adds them)."""
    pid = tl.program_id(0)
    shrink_programs = tl.cdiv(PACKED_RANK, BLOCK_N)
    is_shrink = pid < shrink_programs
    # both programs' rows, then a select: a branch's merge would lose the rows' alignment, and with
    # it the 16-byte weight loads (every load one bf16, the GEMV ~3 us a linear slower: round 11)
    a_rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = (pid - shrink_programs) * BLOCK_N + tl.arange(0, BLOCK_N)
    a_ptrs = a_ptr + tl.minimum(a_rows, PACKED_RANK - 1).to(tl.int64) * K
    if not ONE_SLOT:
        slot = tl.load(idx_ptr)                   # written before the step, not by the last kernels
        a_ptrs += tl.maximum(slot, 0).to(tl.int64) * stride_as
    w_ptrs = w_ptr + tl.maximum(tl.minimum(w_rows, N - 1), 0).to(tl.int64) * stride_wn
    row_ptrs = tl.where(is_shrink, a_ptrs, w_ptrs)
    rows = tl.where(is_shrink, a_rows, w_rows)
    y, rstd = _waited_rows(row_ptrs, x_ptr, r_ptr, s_ptr, nw_ptr, K, eps, pid == 0, PROLOGUE, HAS_RESIDUAL, BLOCK_N,
                           BLOCK_K, NORM_BLOCK, EVEN_K, USE_PDL)
    if is_shrink:
        tl.store(shrunk_ptr + rows, y, mask=rows < PACKED_RANK)
    else:
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _expand_row_kernel(shrunk_ptr, lb_ptr, scale_ptr, idx_ptr, y_ptr, N, stride_bs, RANK: tl.constexpr,
                       SLICE1: tl.constexpr, SLICE2: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """y[rows] += scale[slot] * B[slot][rows] . shrunk[the rows' slice's ranks], in place."""
    slot = tl.load(idx_ptr)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows_in = tl.minimum(rows, N - 1)
    rs = tl.arange(0, RANK)
    # B does not depend on the GEMV before: issue it before the wait
    b = tl.load(lb_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs + rows_in.to(tl.int64)[:, None] * RANK
                + rs[None, :])                                       # [BLOCK, R]
    if USE_PDL:
        # the next linear's programs may start streaming their weights now: their own wait is on
        # this grid, which ends only after the GEMV's (every program here waits for it)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if slot >= 0:
        slice_of_row = (rows_in >= SLICE1).to(tl.int32) + (rows_in >= SLICE2).to(tl.int32)
        sh = tl.load(shrunk_ptr + slice_of_row[:, None] * RANK + rs[None, :])
        y = tl.load(y_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        y += tl.sum(b.to(tl.float32) * sh, axis=1) * tl.load(scale_ptr + slot)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


def _launch(prologue: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora: GemvLoRA,
            residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            defer: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, LoRADelta | None]:
    require_triton(x, weight, lora.lora_a, lora.lora_b)
    assert x.dim() == 2 and x.shape[0] == 1 and weight.stride(1) == 1
    x = x if x.stride(1) == 1 else x.contiguous()
    n, k = weight.shape
    num_slots, packed_rank, in_features = lora.lora_a.shape
    rank = lora.lora_b.shape[2]
    assert in_features == k and lora.lora_b.shape[1] == n and sum(lora.slices) == n and len(lora.slices) <= 3
    assert lora.lora_a.dtype == weight.dtype and rank == next_power_of_2(rank)
    assert lora.lora_a.is_contiguous() and lora.lora_b.is_contiguous()
    assert x.shape[1] == (2 * k if prologue == SILU_MUL else k), (tuple(x.shape), tuple(weight.shape))
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(x) if residual is not None else None
    if residual is not None:
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
    cfg = gemv_config(1, n, k)
    shrink_programs = triton.cdiv(packed_rank, cfg.block_n)
    shrunk = torch.empty(packed_rank, dtype=torch.float32, device=x.device)
    pdl = use_pdl(x)
    _gemv_shrink_kernel[(triton.cdiv(n, cfg.block_n) + shrink_programs,)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else weight, weight,
        bias if bias is not None else weight, y, new_residual if new_residual is not None else x,
        lora.lora_a, lora.indices, shrunk, n, k, weight.stride(0), lora.lora_a.stride(0), eps,
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, PACKED_RANK=packed_rank,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NORM_BLOCK=min(next_power_of_2(k), max(cfg.block_k, 8192)),
        EVEN_K=k % cfg.block_k == 0, USE_PDL=pdl, ONE_SLOT=num_slots == 1, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    delta = LoRADelta(shrunk, lora.lora_b, lora.scale, lora.indices, lora.slices)
    if defer:
        return y, new_residual, delta
    add_lora_delta(y, delta, pdl and EXPAND_PDL)
    return y, new_residual, None


def add_lora_delta(y: torch.Tensor, delta: LoRADelta, pdl: bool | None = None) -> torch.Tensor:
    """The expand launch: y [1, N] += its deferred delta, in place (a consumer that cannot add it)."""
    require_triton(y, delta.lora_b)
    n, rank = y.shape[1], delta.lora_b.shape[2]
    pdl = use_pdl(y) if pdl is None else pdl
    slice1, slice2 = delta.bounds()
    block = max(32, 2048 // rank)
    _expand_row_kernel[(triton.cdiv(n, block),)](
        delta.shrunk, delta.lora_b, delta.scale, delta.indices, y, n, delta.lora_b.stride(0), RANK=rank,
        SLICE1=slice1, SLICE2=slice2, BLOCK=block, USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
    return y


def gemv_lora(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora: GemvLoRA) -> torch.Tensor:
    """x [1, K] @ weight[N, K]^T (+ bias) + the row's LoRA delta -> [1, N] (two launches)."""
    return _launch(PLAIN, x, weight, bias, lora)[0]


def gemv_lora_deferred(prologue: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       lora: GemvLoRA, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                       eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None, LoRADelta]:
    """One launch: y without its delta, (the norm prologue's new residual), and the delta for the
    kernel after to add (kernels/lora_delta.py; `add_lora_delta` where that kernel cannot)."""
    return _launch(prologue, x, weight, bias, lora, residual, norm_weight, eps, defer=True)


def add_rms_norm_gemv_lora(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                           weight: torch.Tensor, bias: torch.Tensor | None, lora: GemvLoRA
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """gemv.add_rms_norm_gemv with the delta of the normed input added: (y [1, N], new residual)."""
    y, new_residual, _ = _launch(NORM, x, weight, bias, lora, residual, norm_weight, eps)
    return y, (new_residual if new_residual is not None else x)


def silu_mul_gemv_lora(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       lora: GemvLoRA) -> torch.Tensor:
    """gemv.silu_mul_gemv with the delta of silu(gate) * up added."""
    return _launch(SILU_MUL, gate_up, weight, bias, lora)[0]


__all__ = ["GemvLoRA", "add_lora_delta", "add_rms_norm_gemv_lora", "gemv_lora", "gemv_lora_deferred", "gemv_lora_ref",
           "silu_mul_gemv_lora"]
