"""LoRA: low-rank adapters on the linear projections, the base weights frozen.

In: a model and (rank, alpha, target names). Out: each targeted linear carries `linear.lora`,
a `LoRA` module whose delta a forward hook on the linear adds to its output (the model has one
forward, serving and training alike); only adapter parameters require gradients. `merge_lora` folds W += (alpha / r) B A into the base
weights for a merged export; `lora_tensors` names the adapters for a PEFT-layout export.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoRA(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.rank = rank
        # A buffer, so the scale travels in state dicts (and so with the adapter on export).
        self.register_buffer("scale", torch.tensor(alpha / rank, dtype=torch.float32))
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))     # zero: training starts at the base model
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype)) * self.scale.to(x.dtype)

    def delta(self) -> torch.Tensor:
        """[out, in] = scale * B @ A, in float32."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scale


def attach_lora(model: nn.Module, rank: int, alpha: float, targets: tuple[str, ...] = DEFAULT_TARGETS) -> int:
    """Freeze the model and give every targeted linear an adapter; returns the adapter count."""
    if rank < 1:
        raise ValueError(f"--lora-rank must be positive, got {rank}")
    for p in model.parameters():
        p.requires_grad_(False)
    count = 0
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in targets and hasattr(module, "weight"):
            out_features, in_features = module.weight.shape
            with torch.device(module.weight.device):
                module.lora = LoRA(in_features, out_features, rank, alpha)
            module.register_forward_hook(_add_lora_delta)
            count += 1
    if not count:
        raise ValueError(f"no linear named {', '.join(targets)} to put LoRA adapters on")
    return count


def _add_lora_delta(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """y = base(x) + lora(x): x [..., in] is the linear's input, output [..., out] its result."""
    return output + module.lora(args[0])


@torch.no_grad()
def merge_lora(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state dict (with `X.lora.lora_A/B` entries) -> base weights with the deltas folded in."""
    out = {k: v for k, v in state.items() if ".lora." not in k}
    for key in [k for k in state if k.endswith(".lora.lora_A")]:
        base = key.removesuffix(".lora.lora_A")
        a, b = state[key].float(), state[f"{base}.lora.lora_B"].float()
        scale = float(state[f"{base}.lora.scale"])
        weight = out[f"{base}.weight"]
        out[f"{base}.weight"] = (weight.float() + scale * (b @ a)).to(weight.dtype)
    return out


def lora_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if ".lora." in k}
