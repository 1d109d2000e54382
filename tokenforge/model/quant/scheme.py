"""A pre-quantized checkpoint's scheme, as parsed from config.json, and what its formats share.

The formats (compressed_tensors.py, awq.py) parse their `quantization_config` into a
`CheckpointScheme`; its `kind` names the method that loads it (registry.CHECKPOINT_METHODS).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

SUPPORTED = "compressed-tensors float-quantized FP8 and pack-quantized W4A16, AWQ gemm, MXFP4 MoE experts"


@dataclass(frozen=True, slots=True)
class CheckpointScheme:
    kind: str                     # ct-fp8 | ct-w4a16 | awq | mxfp4
    label: str                    # for logs and errors
    group_size: int = 0
    symmetric: bool = True
    weight_strategy: str = "channel"     # fp8: tensor | channel
    activations: str | None = None       # fp8: dynamic | static | None (weight-only)
    ignore: tuple[str, ...] = field(default_factory=tuple)

    def ignores(self, hf_name: str) -> bool:
        return any(re.fullmatch(p[3:], hf_name) if p.startswith("re:") else p == hf_name for p in self.ignore)


def unsupported(what: str) -> ValueError:
    return ValueError(f"unsupported pre-quantized checkpoint: {what} (supported: {SUPPORTED})")


def unpack_int32(words: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8C]: nibble i of word c is element 8c + order[i]."""
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    nibbles = ((words[..., None] >> shifts) & 0xF).to(torch.uint8)          # [R, C, 8] by nibble
    out = torch.empty_like(nibbles)
    out[..., list(order)] = nibbles
    return out.reshape(words.shape[0], -1)


def per_row(layer: nn.Module, values: torch.Tensor) -> torch.Tensor:
    """Per-shard scalars [S] -> per output row [N] (fused layers have one scale per checkpoint tensor)."""
    return torch.cat([values[i].expand(size) for i, size in enumerate(layer.shard_sizes())]).float().contiguous()


__all__ = ["CheckpointScheme", "per_row", "unpack_int32", "unsupported"]
