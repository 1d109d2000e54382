"""Tiled GEMM for mid-sized batches: y = x @ W^T, W [N, K] row-major as nn.Linear holds it.

In: x [M, K] (K contiguous), W [N, K] (K contiguous), a `GemmConfig`. M is a runtime argument (one
compile serves every row count); N and K are specialized only by divisibility, so one compile per
config serves all the Llama linears.
Out: y [M, N] in x's dtype, accumulated in fp32.

Why: at serving batch sizes (M = 16-512) a decode step's linears sit near the ridge of an H100,
neither clearly memory- nor compute-bound, and cuBLAS's default picks reach 55-80% of their floor
there (bench/kernels/mid_gemm.py measures it). A kernel whose tiles are chosen per (shape, M) at
start-up can close some of that. Two tile orientations:
- plain: acc [BLOCK_M, BLOCK_N] = x_tile @ W_tile^T; Hopper's wgmma needs BLOCK_M % 64 == 0 and
  4 or 8 warps (below that Triton falls back to mma.sync);
- `swap_ab`: acc [BLOCK_N, BLOCK_M] = W_tile @ x_tile^T, the weight rows on the MMA's M side, so
  a 16- or 32-row batch still runs on wgmma (its N side takes multiples of 8).
Programs walk the M tiles of one weight tile together (GROUP_M ordering): the weight comes from
HBM once and the other row tiles find it in L2.
Split-K (SPLIT_K > 1, for N = 4096 at small M, where the output tiles are fewer than the SMs):
each program writes its fp32 partial to a workspace [SPLIT_K, M, N] and a second kernel adds the
partials in a fixed order, so results are bitwise reproducible (no float atomics).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._triton import cdiv, next_power_of_2, require_triton, tl, triton

SHARED_MEMORY_BUDGET = 227 * 1024       # an H100 block's opt-in limit


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False

    def label(self) -> str:
        swap = " swap" if self.swap_ab else ""
        return (f"{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} sk{self.split_k} "
                f"w{self.num_warps} st{self.num_stages}{swap}")


def gemm_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y [M, N] = x [M, K] @ weight [N, K]^T with fp32 products, rounded once to x's dtype."""
    return (x.float() @ weight.float().t()).to(x.dtype)


def shared_memory_bytes(cfg: GemmConfig, element_size: int = 2) -> int:
    """The pipeline's operand buffers: num_stages copies of an x tile and a W tile."""
    return cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * element_size


def check_config(cfg: GemmConfig, k: int) -> str | None:
    """Why `cfg` cannot run a K-wide GEMM, or None."""
    for name in ("block_m", "block_n", "block_k"):
        size = getattr(cfg, name)
        if size < 16 or size & (size - 1):
            return f"{name} {size} must be a power of two >= 16"
    if cfg.split_k < 1 or cfg.split_k > cdiv(k, cfg.block_k):
        return f"split_k {cfg.split_k} must be 1 .. the {cdiv(k, cfg.block_k)} K tiles"
    if cfg.group_m < 1:
        return "group_m must be >= 1"
    if shared_memory_bytes(cfg) > SHARED_MEMORY_BUDGET:
        return f"{shared_memory_bytes(cfg)} bytes of operand buffers > {SHARED_MEMORY_BUDGET}"
    return None


def row_use(cfg: GemmConfig, m: int) -> float:
    """The fraction of the row tiles' rows that are real rows (1.0: no padding)."""
    return m / (cdiv(m, cfg.block_m) * cfg.block_m)


def default_config(m: int, n: int, k: int) -> GemmConfig:
    """A reasonable tile without a measured table: swapped wgmma tiles for small batches."""
    if m <= 32:
        return GemmConfig(max(16, next_power_of_2(m)), 128, 128, num_stages=4, swap_ab=True)
    if m <= 64:
        return GemmConfig(64, 128, 128, num_stages=3, swap_ab=True)
    return GemmConfig(128, 128, 64, num_warps=8, num_stages=4)


# ---- kernels ----------------------------------------------------------------------------------

@triton.jit
def _tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid: GROUP_M row tiles of one column tile run together."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size = tl.minimum(tiles_m - first_m, GROUP_M)
    local = pid % per_group
    return first_m + local % size, local // size


@triton.jit
def _mma(a, b, acc, F32: tl.constexpr):
    """acc + a @ b; F32 (the CPU interpreter, which has no bf16 dot): in fp32."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["M"])     # one compile for every row count
def _gemm_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, F32: tl.constexpr):
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    tiles = tl.cdiv(K, BLOCK_K)
    per = tl.cdiv(tiles, SPLIT_K)
    t0 = pid_k * per
    t1 = tl.minimum(t0 + per, tiles)
    # Rows past M and columns past N re-read valid ones (unmasked loads); their stores are masked.
    x_ptrs = x_ptr + (rows % M).to(tl.int64)[:, None] * stride_xm + (t0 * BLOCK_K + ks)[None, :]   # [BM, BK]
    w_ptrs = w_ptr + (cols % N).to(tl.int64)[:, None] * stride_wn + (t0 * BLOCK_K + ks)[None, :]   # [BN, BK]
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(t0, t1):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = (t * BLOCK_K + ks) < K
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        if SWAP_AB:
            acc = _mma(w, tl.trans(x), acc, F32)          # [BN, BM] = y^T tile
        else:
            acc = _mma(x, tl.trans(w), acc, F32)          # [BM, BN]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP_AB:
        r, c = rows[None, :], cols[:, None]
    else:
        r, c = rows[:, None], cols[None, :]
    mask = (r < M) & (c < N)
    if SPLIT_K > 1:
        tl.store(ws_ptr + (pid_k * M + r).to(tl.int64) * N + c, acc, mask=mask)
    else:
        tl.store(y_ptr + r.to(tl.int64) * stride_ym + c, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _reduce_kernel(ws_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """y = the sum of the SPLIT_K partials [SPLIT_K, M, N], added in split order (deterministic)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    size = M * N
    mask = offs < size
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + j * size + offs, mask=mask, other=0.0)
    tl.store(y_ptr + (offs // N) * stride_ym + offs % N, acc.to(y_ptr.dtype.element_ty), mask=mask)


# ---- launch -----------------------------------------------------------------------------------

def gemm(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ weight [N, K]^T with `config`'s tiles (default_config when None)."""
    require_triton(x, weight)
    x = x if x.stride(1) == 1 else x.contiguous()
    assert weight.stride(1) == 1, "the weight must be K-contiguous, as nn.Linear holds it"
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k, (tuple(x.shape), tuple(weight.shape))
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert y.shape == (m, n) and y.stride(1) == 1, (tuple(y.shape), y.stride())
    if m == 0:
        return y
    cfg = config or default_config(m, n, k)
    why = check_config(cfg, k)
    assert why is None, why
    split = cfg.split_k
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y   # [S, M, N]
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n), split)
    _gemm_kernel[grid](x, weight, y, ws, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
                       BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                       SPLIT_K=split, SWAP_AB=cfg.swap_ab, EVEN_K=k % cfg.block_k == 0, F32=not x.is_cuda,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        block = 1024
        _reduce_kernel[(cdiv(m * n, block),)](ws, y, m, n, y.stride(0), SPLIT_K=split, BLOCK=block, num_warps=4)
    return y


__all__ = ["GemmConfig", "SHARED_MEMORY_BUDGET", "check_config", "default_config", "gemm", "gemm_ref", "row_use",
           "shared_memory_bytes"]
