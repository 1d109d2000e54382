"""A batch-1 LoRA delta left for the next kernel to add: y[c] += scale[s] * B[s][c] . shrunk[slice(c)].

In: a `LoRADelta`, what kernels/gemv_lora.py leaves when asked to defer its expand: `shrunk` [n*R]
fp32 (the row's p(x) A[s]^T, written by the GEMV's shrink programs), the slot tensors lora_B
[S, N, R] and scale [S] fp32, indices [1] (the row's slot, -1: no adapter) and the packed slices'
sizes (sum N). Out: the consumer (kernels/rms_norm.py, kernels/activation.py) adds the delta to
each element of y it loads, rounded as the expand kernel rounds it (y in fp32 plus the delta, back
to y's dtype), so the result is the one the separate expand gives, up to the order of the rank sum.

Why: at batch 1 the expand is a launch of its own between two dependent kernels, ~3.75 us a linear
on an H100 for under 1% of the step's bytes (BENCHMARKS.md, wave 3 round 10: W1 with one adapter
kept 87-90% of bare). The kernel after the projection reads y once anyway: the post-attention norm
after o_proj, the SwiGLU after gate_up. B does not depend on the kernels before, so its tile is
loaded before the PDL wait (`delta_b`), the sum after it (`add_delta`).

`lora_delta_ref` is the torch computation (the kernels' test, and the CPU path never defers).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._triton import tl, triton


class LoRADelta(NamedTuple):
    """One linear's deferred delta for a one-row step (see the module note)."""
    shrunk: torch.Tensor       # [n*R] fp32
    lora_b: torch.Tensor       # [S, N, R]
    scale: torch.Tensor        # [S] fp32
    indices: torch.Tensor      # [1] int: the row's slot, -1 for none
    slices: tuple[int, ...]    # the packed outputs' sizes (sum N)

    def bounds(self) -> tuple[int, int]:
        """SLICE1, SLICE2: where the second and third packed slices start (N past the last)."""
        n = sum(self.slices)
        starts = [sum(self.slices[:i + 1]) for i in range(len(self.slices))] + [n, n]
        return starts[0], starts[1]

    def kernel_args(self) -> tuple:
        """The pointer arguments of a consumer kernel, in `delta_b` / `add_delta` order."""
        return self.shrunk, self.lora_b, self.scale, self.indices, self.lora_b.stride(0)


def lora_delta_ref(y: torch.Tensor, delta: LoRADelta) -> torch.Tensor:
    """y [1, N] plus the delta, in fp32 then y's dtype (a slot of -1 adds nothing)."""
    slot = int(delta.indices.reshape(-1)[0])
    if slot < 0:
        return y
    rank = delta.lora_b.shape[2]
    parts, start = [], 0
    for j, size in enumerate(delta.slices):
        b = delta.lora_b[slot, start:start + size].float()                       # [size, R]
        parts.append(b @ delta.shrunk[j * rank:(j + 1) * rank].float())
        start += size
    return (y.float() + torch.cat(parts)[None, :] * delta.scale[slot]).to(y.dtype)


@triton.jit
def delta_b(rows, lb_ptr, idx_ptr, stride_bs, n, RANK: tl.constexpr):
    """The B rows [BLOCK, RANK] of output columns `rows` (< n: clamped) for the row's slot (slot 0's
    when it has none; `add_delta` then adds nothing). Independent of the kernels before."""
    slot = tl.load(idx_ptr)
    rs = tl.arange(0, RANK)
    rows_in = tl.minimum(rows, n - 1).to(tl.int64)
    return tl.load(lb_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs + rows_in[:, None] * RANK + rs[None, :])


@triton.jit
def add_delta(x, b, rows, shrunk_ptr, scale_ptr, idx_ptr, RANK: tl.constexpr, SLICE1: tl.constexpr,
              SLICE2: tl.constexpr):
    """x [BLOCK] (columns `rows` of the projection's output, its dtype) plus their delta, rounded
    back to x's dtype: after the PDL wait (shrunk is the previous kernel's output)."""
    slot = tl.load(idx_ptr)
    rs = tl.arange(0, RANK)
    slice_of_row = (rows >= SLICE1).to(tl.int32) + (rows >= SLICE2).to(tl.int32)
    sh = tl.load(shrunk_ptr + slice_of_row[:, None] * RANK + rs[None, :])
    d = tl.sum(b.to(tl.float32) * sh, axis=1) * tl.load(scale_ptr + tl.maximum(slot, 0))
    return tl.where(slot >= 0, (x.to(tl.float32) + d).to(x.dtype), x)


@triton.jit
def delta_b_2d(rows, lb_ptr, idx_ptr, stride_bs, n, RANK: tl.constexpr):
    """`delta_b` for a [H, W] tile of output columns (a head's halves): B [H, W, RANK]."""
    slot = tl.load(idx_ptr)
    rs = tl.arange(0, RANK)
    rows_in = tl.minimum(rows, n - 1).to(tl.int64)
    return tl.load(lb_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs + rows_in[:, :, None] * RANK
                   + rs[None, None, :])


@triton.jit
def add_delta_2d(x, b, rows, shrunk_ptr, scale_ptr, idx_ptr, RANK: tl.constexpr, SLICE1: tl.constexpr,
                 SLICE2: tl.constexpr):
    """`add_delta` for a [H, W] tile."""
    slot = tl.load(idx_ptr)
    rs = tl.arange(0, RANK)
    slice_of_row = (rows >= SLICE1).to(tl.int32) + (rows >= SLICE2).to(tl.int32)
    sh = tl.load(shrunk_ptr + slice_of_row[:, :, None] * RANK + rs[None, None, :])
    d = tl.sum(b.to(tl.float32) * sh, axis=2) * tl.load(scale_ptr + tl.maximum(slot, 0))
    return tl.where(slot >= 0, (x.to(tl.float32) + d).to(x.dtype), x)


__all__ = ["LoRADelta", "add_delta", "add_delta_2d", "delta_b", "delta_b_2d", "lora_delta_ref"]
