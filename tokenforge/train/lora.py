"""LoRA: low-rank adapters on the linear projections, the base weights frozen.

In: a model and (rank, alpha, target names). Out: each targeted linear carries a `LoRA` hook
(model/layers/lora.py) in its `lora` slot, whose delta the linear adds to its output; only
adapter parameters require gradients. `merge_lora` folds W += (alpha / r) B A into the base
weights for a merged export; `lora_tensors` names the adapters for a PEFT-layout export.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenforge.model.layers.lora import LoRA

DEFAULT_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def attach_lora(model: nn.Module, rank: int, alpha: float, targets: tuple[str, ...] = DEFAULT_TARGETS) -> int:
    """Freeze the model and give every targeted linear an adapter; returns the adapter count."""
    if rank < 1:
        raise ValueError(f"--lora-rank must be positive, got {rank}")
    for p in model.parameters():
        p.requires_grad_(False)
    count = 0
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in targets and hasattr(module, "lora"):
            with torch.device(module.weight.device):
                module.lora = LoRA(module.in_features, module.out_features, rank, alpha)
            count += 1
    if not count:
        raise ValueError(f"no linear named {', '.join(targets)} to put LoRA adapters on")
    return count


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
