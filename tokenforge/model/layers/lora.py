"""LoRA as a hook on a linear's output: y + scale * (x A^T) B^T, the base weight untouched.

Every parallel linear has a `lora` slot (linear.py). A hook there is called as `hook(x, y)` with
the projection's input x [..., in] and output y [..., out] and returns the new output. It runs on
this rank's shard before the row-parallel all-reduce: a row-parallel adapter's A is split by input
columns like the weight, so its partial deltas sum with the partial products. A linear with a hook
skips its fused norm / SwiGLU kernels (the hook needs the projection's input), and the hook works
with any quant method, since it only sees x and y.

- `LoRA`: one adapter for every token, what `tokenforge train` attaches (train/lora.py):
  lora_A [r, in] (Kaiming), lora_B [out, r] (zero, so training starts at the base model) and the
  `scale` buffer alpha / r, which travels in state dicts and so with an exported adapter.
- `LoRASlots`: adapters in fixed slots, each token row picking one (or none, -1) by the index the
  forward context carries (`ForwardContext.lora_indices` [T]); the torch reference for batched
  multi-adapter serving. Outside a forward context, or with no indices, it adds nothing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenforge.model.forward_context import current_forward_context


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

    def delta_of(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> scale * (x A^T) B^T [..., out], in x's dtype."""
        return F.linear(F.linear(x, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype)) * self.scale.to(x.dtype)

    def delta(self) -> torch.Tensor:
        """[out, in] = scale * B @ A, in float32 (what merging adds to the weight)."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scale


class LoRASlots(nn.Module):
    """`num_slots` adapters of rank <= max_rank on one linear: lora_A [S, R, in], lora_B [S, out, R]
    (a smaller rank is zero-padded, which changes nothing) and scale [S]."""

    def __init__(self, num_slots: int, in_features: int, out_features: int, max_rank: int,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.register_buffer("lora_A", torch.zeros(num_slots, max_rank, in_features, dtype=dtype))
        self.register_buffer("lora_B", torch.zeros(num_slots, out_features, max_rank, dtype=dtype))
        self.register_buffer("scale", torch.zeros(num_slots, dtype=torch.float32))

    @torch.no_grad()
    def set_slot(self, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> None:
        """Put an adapter (A [r, in], B [out, r]) into a slot."""
        rank, max_rank = lora_a.shape[0], self.lora_A.shape[1]
        if rank > max_rank or lora_b.shape[1] != rank:
            raise ValueError(f"a LoRA adapter of rank {rank} (B of rank {lora_b.shape[1]}) does not fit slots of "
                             f"rank {max_rank}")
        self.lora_A[slot].zero_()[:rank].copy_(lora_a)
        self.lora_B[slot].zero_()[:, :rank].copy_(lora_b)
        self.scale[slot] = scale

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx = current_forward_context()
        indices = None if ctx is None else ctx.lora_indices       # [T] slot per token row, -1 for none
        if indices is None:
            return y
        x2 = x.reshape(-1, x.shape[-1])                             # [T, in]
        slots = indices.clamp(min=0)
        shrunk = torch.einsum("ti,tri->tr", x2, self.lora_A[slots].to(x.dtype))            # [T, R]
        delta = torch.einsum("tr,tor->to", shrunk, self.lora_B[slots].to(x.dtype))         # [T, out]
        weight = torch.where(indices >= 0, self.scale[slots], 0.0).to(x.dtype)            # [T]
        return y + (delta * weight[:, None]).reshape(y.shape)


__all__ = ["LoRA", "LoRASlots"]
