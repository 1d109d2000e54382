"""LoRA as a hook on a linear's output: y + scale * (x A^T) B^T, the base weight untouched.

Every parallel linear has a `lora` slot (linear.py). A hook there is called as `hook(x, y)` with
the projection's input x [..., in] and output y [..., out] and returns the new output. It runs on
this rank's shard before the row-parallel all-reduce: a row-parallel adapter's A is split by input
columns like the weight, so its partial deltas sum with the partial products. The hook works with
any quant method, since it only sees x and y; a method whose kernels add the delta themselves
(the dense batch-1 GEMV, kernels/gemv_lora.py, which keeps the fused norm / SwiGLU prologue)
gets the slot tensors from `fused_operand()` instead, and the hook is not called.

- `LoRA`: one adapter for every token, what `tokenforge train` attaches (train/lora.py):
  lora_A [r, in] (Kaiming), lora_B [out, r] (zero, so training starts at the base model) and the
  `scale` buffer alpha / r, which travels in state dicts and so with an exported adapter.
- `LoRASlots`: adapters in fixed slots, each token row picking one (or none, -1) by the index the
  forward context carries (`ForwardContext.lora_indices` [T], built once per step by the runner);
  batched multi-adapter serving, computed by kernels/lora.py (Triton shrink/expand on CUDA over
  the rows grouped by slot, a plan the step's first LoRA linear makes and keeps in the context;
  the torch reference elsewhere). Packed linears (qkv, gate_up) keep one A per packed projection, so
  a PEFT adapter's separate q/k/v (gate/up) adapters map onto the fused linear without merging.
  Outside a forward context, or with no indices, it adds nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tokenforge import envs
from tokenforge.kernels.gemv_lora import GemvLoRA
from tokenforge.kernels.lora import (
    SHRINK_WAVES, add_lora, expand_after, lora_expand_rows, lora_expand_rows_reference, lora_plan, shrink_beside,
)
from tokenforge.model.forward_context import current_forward_context


class ShrinkInGemm(NamedTuple):
    """A linear whose LoRA slots' A sit under its weight (QuantMethod.fuse_lora_a): one product
    x [weight; A of every slot]^T gives y in its first `rows` columns and every slot's shrunk ranks
    after them; `expand(shrunk, y)` adds each row's own slot's delta into y (in place) and returns it."""
    weight: torch.Tensor             # [rows + S*n*R, in]
    bias: torch.Tensor | None        # [rows + S*n*R] (zero past rows) or None
    rows: int
    expand: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # steps of more rows (prefill chunks) keep the shrink kernel: there the product is bound by its
    # FLOPs, which the extra columns add to, and a launch's fixed latency is small beside it
    max_rows: int = 512


class LoRA(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.rank = rank
        self.register_buffer("scale", torch.tensor(alpha / rank, dtype=torch.float32))
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y + self.delta_of(x)

    def begin(self, x: torch.Tensor) -> None:
        """Nothing to start before the projection (see LoRASlots.begin)."""
        return None

    def finish(self, started: None, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self(x, y)

    def delta_of(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> scale * (x A^T) B^T [..., out], in x's dtype."""
        return F.linear(F.linear(x, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype)) * self.scale.to(x.dtype)

    def fused_operand(self) -> None:
        """Training's adapter is never fused into a kernel (the kernels have no backward)."""
        return None

    def delta(self) -> torch.Tensor:
        """[out, in] = scale * B @ A, in float32 (what merging adds to the weight)."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scale


class LoRASlots(nn.Module):
    """`num_slots` adapters of rank <= max_rank on one linear whose output packs `slices` (the
    q/k/v or gate/up projections fused into it; one slice otherwise): lora_A [S, n*R, in] holds
    each slice's A in its own R rows, lora_B [S, out, R] each output row's B, and scale [S] fp32.
    A smaller rank is zero-padded, which changes nothing. R is max_rank rounded up to a power of
    two >= 16 (what the Triton kernels tile by)."""

    def __init__(self, num_slots: int, in_features: int, out_features: int, max_rank: int,
                 dtype: torch.dtype | None = None, slices: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.slices = tuple(slices) if slices is not None else (out_features,)
        assert sum(self.slices) == out_features, f"slices {self.slices} do not sum to {out_features}"
        self.max_rank = max_rank
        self.rank = max(16, 1 << (max_rank - 1).bit_length())      # R, the padded rank
        n = len(self.slices)
        self.register_buffer("lora_A", torch.zeros(num_slots, n * self.rank, in_features, dtype=dtype))
        self.register_buffer("lora_B", torch.zeros(num_slots, out_features, self.rank, dtype=dtype))
        self.register_buffer("scale", torch.zeros(num_slots, dtype=torch.float32))
        self.tiles = envs.lora_tiles()      # the kernels' tile arguments ({}: their defaults)
        self._expand_tiles = {k: v for k, v in self.tiles.items() if k != "shrink_waves"}
        self.side_stream = None             # a CUDA stream the shrink runs on beside the projection
        self.in_gemm: ShrinkInGemm | None = None    # the shrink inside the base product (`put_a_under`)

    def put_a_under(self, linear: nn.Module) -> bool:
        """Keep every slot's A under the linear's weight (its method's `fuse_lora_a`), so a step of
        more than one row computes the shrink in the base product's extra columns and launches only
        the expand; the one-row GEMV path is unchanged. Whether the method could."""
        fused = linear.quant_method.fuse_lora_a(linear, self.lora_A.shape[0] * self.lora_A.shape[1])
        if fused is None:
            return False
        weight, bias = fused
        rows = linear.weight.shape[0]
        weight[rows:].view_as(self.lora_A).copy_(self.lora_A)
        self.lora_A = weight[rows:].view_as(self.lora_A)          # slot writes now land under the weight
        self.in_gemm = ShrinkInGemm(weight, bias, rows, self._expand_rows)
        return True

    def _expand_rows(self, shrunk: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx = current_forward_context()
        indices = ctx.lora_indices
        if not y.is_cuda:
            return lora_expand_rows_reference(shrunk, y, self.lora_B, self.scale, indices, self.slices)
        return lora_expand_rows(shrunk, y, self.lora_B, self.scale, self.slices, self._plan(ctx, indices),
                                **self._expand_tiles)

    @torch.no_grad()
    def set_slot(self, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> None:
        """Put one adapter of the whole linear (A [r, in], B [out, r]) into a slot: every slice
        shares A, and takes its rows of B."""
        self.clear_slot(slot)
        start = 0
        for j, size in enumerate(self.slices):
            self.set_slice(slot, j, lora_a, lora_b[start:start + size])
            start += size
        self.scale[slot] = scale

    @torch.no_grad()
    def set_slice(self, slot: int, j: int, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """Slice j's adapter (A [r, in], B [slice rows, r]) into a slot cleared before."""
        rank = lora_a.shape[0]
        if rank > self.max_rank or lora_b.shape[1] != rank:
            raise ValueError(f"a LoRA adapter of rank {rank} (B of rank {lora_b.shape[1]}) does not fit slots of "
                             f"rank {self.max_rank}")
        start = sum(self.slices[:j])
        self.lora_A[slot, j * self.rank:j * self.rank + rank].copy_(lora_a, non_blocking=True)
        self.lora_B[slot, start:start + self.slices[j], :rank].copy_(lora_b, non_blocking=True)

    @torch.no_grad()
    def clear_slot(self, slot: int, scale: float = 1.0) -> None:
        self.lora_A[slot].zero_()
        self.lora_B[slot].zero_()
        self.scale[slot] = scale

    def fused_operand(self) -> GemvLoRA | None:
        """The slot tensors and this step's row indices for kernels that add the delta themselves;
        None where there is nothing to add (no forward context or no indices)."""
        ctx = current_forward_context()
        indices = None if ctx is None else ctx.lora_indices
        return None if indices is None else GemvLoRA(self.lora_A, self.lora_B, self.scale, indices, self.slices,
                                                     self.in_gemm)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx = current_forward_context()
        indices = None if ctx is None else ctx.lora_indices       # [T] slot per token row, -1 for none
        if indices is None:
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])     # [T, in], [T, out]
        plan = self._plan(ctx, indices) if x2.is_cuda else None
        return add_lora(x2, y2, self.lora_A, self.lora_B, self.scale, indices, self.slices, plan,
                        **self.tiles).reshape(y.shape)

    def _plan(self, ctx, indices: torch.Tensor):
        """The rows grouped by slot, made once per step (on the current stream) for all the linears."""
        plan = ctx.lora_plan
        if plan is None or plan.rows.shape[0] != indices.shape[0]:
            plan = ctx.lora_plan = lora_plan(indices, self.lora_A.shape[0])
        return plan

    def begin(self, x: torch.Tensor):
        """Start the shrink (x A^T, kernels/lora.py) on the side stream before the base projection
        is launched, so the two run side by side; `finish` joins it and adds the expand. None (the
        whole delta left to `finish` / forward) without a side stream, indices or rows."""
        if self.side_stream is None:        # the default: no forward-context lookup on the serial path
            return None
        ctx = current_forward_context()
        indices = None if ctx is None else ctx.lora_indices
        if indices is None or not x.is_cuda or indices.shape[0] == 0:
            return None
        plan = self._plan(ctx, indices)
        waves = self.tiles.get("shrink_waves", SHRINK_WAVES)
        return shrink_beside(self.side_stream, x.reshape(-1, x.shape[-1]), self.lora_A, plan, waves), plan

    def finish(self, started, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if started is None:
            return self(x, y)
        partial, plan = started
        y2 = expand_after(self.side_stream, partial, y.reshape(-1, y.shape[-1]), self.lora_B, self.scale,
                          self.slices, plan, **self._expand_tiles)
        return y2.reshape(y.shape)


__all__ = ["LoRA", "LoRASlots"]
