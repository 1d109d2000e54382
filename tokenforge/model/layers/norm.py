"""RMSNorm, with the residual add fused in: forward(x, residual) -> (normed, x + residual).

Numerics follow HF Llama: the residual sum is in the model dtype, the variance in fp32, and the
normalised value is rounded to the model dtype before the weight multiplies it.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenforge.model.layers.kernel_dispatch import triton_ops
from tokenforge.model.layers.parallel import default_weight_loader, new_parameter


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter(hidden_size, dtype=params_dtype, weight_loader=default_weight_loader)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, pending=None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`pending`: a LoRA delta x still owes (kernels/lora_delta.py, left by the projection that
        made x, only on the Triton path), added as the kernel loads x."""
        ops = triton_ops(x.device)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps, delta=pending) if ops else self._norm(x)
        if ops is not None:
            return ops.fused_add_rms_norm(x, residual, self.weight, self.eps, delta=pending)
        x = x + residual                        # [T, H] the new residual stream
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        variance = xf.pow(2).mean(-1, keepdim=True)     # [T, 1]
        return self.weight * (xf * torch.rsqrt(variance + self.eps)).to(x.dtype)
