"""Batched multi-adapter LoRA: y[t] += scale[s] * (x[t] A[s]^T) B[s]^T with s = indices[t] per row.

In: x [T, in] (the projection's input), y [T, out] (its output), the slot tensors of one linear
(model/layers/lora.py): lora_A [S, n*R, in] (the n packed slices' A, R rank rows each), lora_B
[S, out, R], scale [S] fp32, and indices [T] int (-1: the base model, no delta). `slices` are the
output sizes of the packed projections (q/k/v, gate/up; one slice for the others): output column
c of slice j reads the shrunk ranks j*R .. (j+1)*R. Out: y with the deltas added.

Two steps, as in Punica / S-LoRA: shrink (x A^T: [T, n*R], fp32) then expand (into y). The Triton
kernels take the per-row index as a tensor and never sync with the host, so they run inside CUDA
graphs: each program covers BLOCK_M consecutive rows and loops over the slots, multiplying only
when some row of its block uses that slot (a prefill chunk is one adapter, so its blocks do one
slot's work; a decode block does the slots its rows use). The shrink also splits the input dim
(256 columns a program, partial sums added in order), so a decode batch still fills the GPU.

`lora_reference` is the torch computation (the CPU path and the kernels' test): both GEMMs over
every slot at once, each row masked to its own, so no host sync and no per-row gather either.
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, next_power_of_2, require_triton, tl, triton


def lora_reference(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   scale: torch.Tensor, indices: torch.Tensor, slices: tuple[int, ...]) -> torch.Tensor:
    num_slots, packed_rank, _ = lora_a.shape
    rank, num_tokens = lora_b.shape[2], x.shape[0]
    weight = (indices[:, None] == torch.arange(num_slots, device=x.device)).to(x.dtype)   # [T, S]; -1: none
    weight = weight * scale.to(x.dtype)
    shrunk = (x @ lora_a.reshape(num_slots * packed_rank, -1).t()).view(num_tokens, num_slots, -1, rank)
    shrunk = shrunk * weight[:, :, None, None]                                             # [T, S, n, R]
    deltas, start = [], 0
    for j, size in enumerate(slices):
        b = lora_b[:, start:start + size].permute(1, 0, 2).reshape(size, num_slots * rank)  # [size, S*R]
        deltas.append(shrunk[:, :, j].reshape(num_tokens, -1) @ b.t())
        start += size
    return y + torch.cat(deltas, dim=-1)


def add_lora(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             scale: torch.Tensor, indices: torch.Tensor, slices: tuple[int, ...]) -> torch.Tensor:
    """The kernels on CUDA (y updated in place), the reference elsewhere."""
    if HAS_TRITON and x.is_cuda:
        return lora_shrink_expand(x, y, lora_a, lora_b, scale, indices, slices)
    return lora_reference(x, y, lora_a, lora_b, scale, indices, slices)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, idx_ptr, out_ptr, num_tokens, in_features, split_size, stride_x, stride_as,
                   stride_ar, stride_split, stride_o, NUM_SLOTS: tl.constexpr, PACKED_RANK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """One (row block, rank block, K split): out[split, rows, ranks] = x[rows, K split] A[slot]^T."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    k_start = tl.program_id(2) * split_size
    row_ok = rows < num_tokens
    slot_of_row = tl.load(idx_ptr + rows, mask=row_ok, other=-1)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    for s in range(NUM_SLOTS):
        mine = slot_of_row == s
        if tl.sum(mine.to(tl.int32), axis=0) > 0:
            part = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k0 in range(k_start, k_start + split_size, BLOCK_K):
                k = k0 + ks
                k_ok = k < in_features
                xt = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                             mask=mine[:, None] & k_ok[None, :], other=0.0)
                at = tl.load(a_ptr + s * stride_as + ranks[:, None] * stride_ar + k[None, :],
                             mask=(ranks[:, None] < PACKED_RANK) & k_ok[None, :], other=0.0)
                part += tl.dot(xt, tl.trans(at))
            acc = tl.where(mine[:, None], part, acc)
    out = out_ptr + tl.program_id(2) * stride_split
    tl.store(out + rows[:, None].to(tl.int64) * stride_o + ranks[None, :], acc,
             mask=row_ok[:, None] & (ranks[None, :] < PACKED_RANK))


@triton.jit
def _expand_kernel(s_ptr, b_ptr, scale_ptr, idx_ptr, y_ptr, num_tokens, out_features, stride_s, stride_bs,
                   stride_bn, stride_y, NUM_SLOTS: tl.constexpr, RANK: tl.constexpr, NUM_SLICES: tl.constexpr,
                   SLICE1: tl.constexpr, SLICE2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col0 = tl.program_id(1) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < num_tokens, cols < out_features
    slot_of_row = tl.load(idx_ptr + rows, mask=row_ok, other=-1)
    # the packed slice of each output column (its shrunk ranks start at slice * RANK); a bound
    # past the last slice is out_features, which no column reaches
    slice_of_col = (cols >= SLICE1).to(tl.int32) + (cols >= SLICE2).to(tl.int32)
    rs = tl.arange(0, RANK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(NUM_SLOTS):
        mine = slot_of_row == s
        if tl.sum(mine.to(tl.int32), axis=0) > 0:
            bt = tl.load(b_ptr + s * stride_bs + cols[None, :].to(tl.int64) * stride_bn + rs[:, None],
                         mask=col_ok[None, :], other=0.0)                                      # [R, BLOCK_N]
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(NUM_SLICES):
                lo = 0 if j == 0 else (SLICE1 if j == 1 else SLICE2)
                hi = SLICE1 if j == 0 else (SLICE2 if j == 1 else out_features)
                if (col0 < hi) & (col0 + BLOCK_N > lo):      # only the slices this column block meets
                    st = tl.load(s_ptr + rows[:, None].to(tl.int64) * stride_s + j * RANK + rs[None, :],
                                 mask=mine[:, None], other=0.0)                                # [BLOCK_M, R]
                    d = tl.dot(st.to(bt.dtype), bt)
                    part += tl.where((slice_of_col == j)[None, :], d, 0.0)
            acc = tl.where(mine[:, None], part * tl.load(scale_ptr + s), acc)
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
    mask = (row_ok & (slot_of_row >= 0))[:, None] & col_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def lora_shrink_expand(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       scale: torch.Tensor, indices: torch.Tensor, slices: tuple[int, ...]) -> torch.Tensor:
    """The Triton path of `lora_reference`; y [T, out] (contiguous rows) is updated in place."""
    require_triton(x, y, lora_a, lora_b)
    assert len(slices) <= 3 and sum(slices) == y.shape[1] and x.stride(-1) == 1 and y.stride(-1) == 1
    num_slots, packed_rank, in_features = lora_a.shape
    rank, (num_tokens, out_features) = lora_b.shape[2], y.shape
    assert rank == next_power_of_2(rank) and rank >= 16, "slot ranks are powers of two >= 16 (tl.dot, tl.arange)"
    assert lora_a.stride(-1) == 1 and lora_b.stride(-1) == 1
    # Split K so that a decode batch (few row blocks, a rank block or two) still fills the GPU; the
    # partial sums are added in a fixed order afterwards, so the result does not depend on timing.
    block_m = 16 if num_tokens <= 128 else (32 if num_tokens <= 1024 else 64)
    split_size = 256 if in_features > 256 else triton.next_power_of_2(in_features)
    splits = triton.cdiv(in_features, split_size)
    partial = torch.empty(splits, num_tokens, packed_rank, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(packed_rank, 64), splits)
    _shrink_kernel[grid](x, lora_a, indices, partial, num_tokens, in_features, split_size, x.stride(0),
                         lora_a.stride(0), lora_a.stride(1), partial.stride(0), partial.stride(1),
                         NUM_SLOTS=num_slots, PACKED_RANK=packed_rank, BLOCK_M=block_m, BLOCK_R=64, BLOCK_K=64)
    shrunk = partial.sum(0) if splits > 1 else partial[0]                   # [T, n*R] fp32
    bounds = [sum(slices[:i + 1]) for i in range(len(slices))] + [out_features] * 2
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(out_features, 64))
    _expand_kernel[grid](shrunk, lora_b, scale, indices, y, num_tokens, out_features, shrunk.stride(0),
                         lora_b.stride(0), lora_b.stride(1), y.stride(0), NUM_SLOTS=num_slots, RANK=rank,
                         NUM_SLICES=len(slices), SLICE1=bounds[0], SLICE2=bounds[1], BLOCK_M=block_m, BLOCK_N=64)
    return y


__all__ = ["add_lora", "lora_reference", "lora_shrink_expand"]
