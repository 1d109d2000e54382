"""One-row GEMV with the multi-LoRA delta in the same launch: y = p(x) W^T + scale[s] B[s] (A[s] p(x)).

In: x [1, K] (or [1, 2K] = [gate | up] for the SiLU-and-mul prologue), W [N, K], optional bias
[N], and a `GemvLoRA` (one linear's slots, model/layers/lora.py): lora_A [S, n*R, K], lora_B
[S, N, R], scale [S] fp32, indices [1] (the row's slot, -1: none), the packed slices' sizes and
`sync`, this linear's two int64 counters (`new_sync`). p is one of gemv.py's
prologues (none, add + RMSNorm, SiLU-and-mul), so a linear with an adapter keeps its fused
prologue. Out: y [1, N] (and the new residual for the norm prologue), as gemv.py plus
kernels/lora.py would give, with the delta added in fp32 before y is rounded.

Why one launch: at batch 1 a step has 128 adapted linears, and a separate shrink and expand
launch each cost about as much as a small GEMV (bench/NOTES.md, BENCHMARKS.md round 4); the LoRA
weights themselves are under 1% of the bytes. The shrink is more rows of the same GEMV: the grid
has cdiv(n*R, BLOCK_N) extra programs that multiply p(x) by A[s]'s rows instead of W's, with the
same prologue, into an fp32 scratch vector. Every W program then adds its rows' B[s] . shrunk,
which needs the whole shrunk vector: it spins until the shrink programs have published theirs.
That cannot deadlock: each program takes a ticket (an atomic counter) as it starts and the
shrink work goes to the first tickets of a launch, so a spinning program only waits for programs
already running, which wait for nothing. The counters only grow: every launch for a linear has the
same grid (its config depends on the weight's shape alone), so ticket // programs is the launch
and ticket % programs the program's work, and the done counter's target grows by the shrink
programs each launch. Nothing resets them (int64 does not wrap), and the kernel replays in CUDA
graphs. Two atomics per program, on two cache lines. The W programs still issue their first
weight tile before griddepcontrol.wait (gemv.py); the shrink programs hold up nobody until the end.

`gemv_lora_ref` is the torch computation (gemv.py's reference, then kernels/lora.py's).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._triton import next_power_of_2, require_triton, tl, triton, use_pdl
from .activation import silu_and_mul_ref
from .gemv import NORM, PLAIN, SILU_MUL, _fma, _row_rstd, _x_chunk, gemv_config
from .lora import lora_reference
from .rms_norm import fused_add_rms_norm_ref, rms_norm_ref


class GemvLoRA(NamedTuple):
    """One linear's adapter slots as the fused GEMV reads them (see the module note)."""
    lora_a: torch.Tensor      # [S, n*R, K]
    lora_b: torch.Tensor      # [S, N, R]
    scale: torch.Tensor       # [S] fp32
    indices: torch.Tensor     # [1] int: the row's slot, -1 for none
    slices: tuple[int, ...]   # the packed outputs' sizes (sum N)
    sync: torch.Tensor        # [2 * SYNC_STRIDE] int64: [0] tickets taken, [SYNC_STRIDE] shrink programs done


SYNC_STRIDE = 16              # int64s between the two counters: 128 bytes, two L2 lines


def new_sync(device: torch.device | str | None = None) -> torch.Tensor:
    """A linear's counters for the fused GEMV; they only grow (see the module note)."""
    return torch.zeros(2 * SYNC_STRIDE, dtype=torch.int64, device=device)


def gemv_lora_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora: GemvLoRA,
                  residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                  prologue: int = PLAIN) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prologue's input h, y = h W^T + b in fp32, the delta of h added, then rounded once."""
    new_residual = None
    if prologue == NORM and residual is None:
        h = rms_norm_ref(x, norm_weight, eps)
    elif prologue == NORM:
        h, new_residual = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
    else:
        h = silu_and_mul_ref(x) if prologue == SILU_MUL else x
    y = h.float() @ weight.float().t() + (bias.float() if bias is not None else 0.0)
    out = lora_reference(h.float(), y, lora.lora_a.float(), lora.lora_b.float(), lora.scale, lora.indices, lora.slices)
    return out.to(x.dtype), new_residual


@triton.jit
def _gemv_lora_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, s_ptr, a_ptr, lb_ptr, scale_ptr, idx_ptr, shrunk_ptr, sync_ptr,
    N, K, stride_wn, stride_as, stride_bs, eps,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    PACKED_RANK: tl.constexpr, RANK: tl.constexpr, SLICE1: tl.constexpr, SLICE2: tl.constexpr,
    SHRINK_PROGRAMS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr,
    EVEN_K: tl.constexpr, SYNC_STRIDE: tl.constexpr, USE_PDL: tl.constexpr,
):
    programs = SHRINK_PROGRAMS + tl.cdiv(N, BLOCK_N)
    taken = tl.atomic_add(sync_ptr, 1)            # the order programs start in: shrink work first
    ticket = (taken % programs).to(tl.int32)
    shrunk_target = (taken // programs + 1) * SHRINK_PROGRAMS   # the done count once this launch's are
    slot = tl.load(idx_ptr)                       # written before the step, not by the last kernels
    is_shrink = ticket < SHRINK_PROGRAMS
    ks = tl.arange(0, BLOCK_K)
    if is_shrink:
        rows = ticket * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ptrs = a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_as + tl.minimum(rows, PACKED_RANK - 1) * K
    else:
        rows = (ticket - SHRINK_PROGRAMS) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ptrs = w_ptr + tl.minimum(rows, N - 1).to(tl.int64) * stride_wn
    w_ptrs = row_ptrs[:, None] + ks[None, :]
    # W rows never depend on the previous kernel: start streaming them before the wait
    if EVEN_K:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs, mask=(ks < K)[None, :], other=0.0, eviction_policy="evict_first")
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    ms = tl.zeros([1], dtype=tl.int64)
    m_mask = ms < 1
    rstd = tl.zeros([1], dtype=tl.float32)
    if PROLOGUE == 1:
        rstd = _row_rstd(x_ptr, r_ptr, s_ptr, ms, m_mask, K, 0, 0, 0, eps, ticket == 0, HAS_RESIDUAL, 1, NORM_BLOCK)
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
    y = tl.sum(acc, axis=1)                                          # [BLOCK_N] fp32
    if is_shrink:
        tl.store(shrunk_ptr + rows, y, mask=rows < PACKED_RANK)
        tl.debug_barrier()                        # every thread's stores before the release below
        tl.atomic_add(sync_ptr + SYNC_STRIDE, 1, sem="release")
    else:
        if slot >= 0:
            rs = tl.arange(0, RANK)
            rows_in = tl.minimum(rows, N - 1)
            slice_of_row = (rows_in >= SLICE1).to(tl.int32) + (rows_in >= SLICE2).to(tl.int32)
            b = tl.load(lb_ptr + slot.to(tl.int64) * stride_bs + rows_in.to(tl.int64)[:, None] * RANK
                        + rs[None, :]).to(tl.float32)                  # [BLOCK_N, R]
            while tl.atomic_add(sync_ptr + SYNC_STRIDE, 0, sem="acquire") < shrunk_target:
                pass
            sh = tl.load(shrunk_ptr + slice_of_row[:, None] * RANK + rs[None, :], volatile=True)
            y += tl.sum(b * sh, axis=1) * tl.load(scale_ptr + slot)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


def _launch(prologue: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora: GemvLoRA,
            residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
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
    bounds = [sum(lora.slices[:i + 1]) for i in range(len(lora.slices))] + [n] * 2
    pdl = use_pdl(x)
    _gemv_lora_kernel[(shrink_programs + triton.cdiv(n, cfg.block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else weight, weight,
        bias if bias is not None else weight, y, new_residual if new_residual is not None else x,
        lora.lora_a, lora.lora_b, lora.scale, lora.indices, shrunk, lora.sync,
        n, k, weight.stride(0), lora.lora_a.stride(0), lora.lora_b.stride(0), eps,
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        PACKED_RANK=packed_rank, RANK=rank, SLICE1=bounds[0], SLICE2=bounds[1], SHRINK_PROGRAMS=shrink_programs,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NORM_BLOCK=min(next_power_of_2(k), max(cfg.block_k, 8192)),
        EVEN_K=k % cfg.block_k == 0, SYNC_STRIDE=SYNC_STRIDE, USE_PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        launch_pdl=pdl,
    )
    return y, new_residual


def gemv_lora(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora: GemvLoRA) -> torch.Tensor:
    """x [1, K] @ weight[N, K]^T (+ bias) + the row's LoRA delta -> [1, N]."""
    return _launch(PLAIN, x, weight, bias, lora)[0]


def add_rms_norm_gemv_lora(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                           weight: torch.Tensor, bias: torch.Tensor | None, lora: GemvLoRA
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """gemv.add_rms_norm_gemv with the delta of the normed input added: (y [1, N], new residual)."""
    y, new_residual = _launch(NORM, x, weight, bias, lora, residual, norm_weight, eps)
    return y, (new_residual if new_residual is not None else x)


def silu_mul_gemv_lora(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       lora: GemvLoRA) -> torch.Tensor:
    """gemv.silu_mul_gemv with the delta of silu(gate) * up added."""
    return _launch(SILU_MUL, gate_up, weight, bias, lora)[0]


__all__ = ["SYNC_STRIDE", "GemvLoRA", "add_rms_norm_gemv_lora", "gemv_lora", "gemv_lora_ref", "new_sync",
           "silu_mul_gemv_lora"]
