"""SiluAndMul: the SwiGLU gate, silu(gate) * up over a fused [T, 2I] gate_up output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenforge.model.layers.kernel_dispatch import triton_ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor, pending=None) -> torch.Tensor:
        """`pending`: a LoRA delta x still owes (kernels/lora_delta.py, left by the gate_up
        projection, only on the Triton path), added as the kernel loads x."""
        ops = triton_ops(x.device)
        if ops is not None:
            return ops.silu_and_mul(x, delta=pending)
        gate, up = x.chunk(2, dim=-1)       # [T, I] each
        return F.silu(gate).mul_(up)        # one [T, I] temporary instead of two
