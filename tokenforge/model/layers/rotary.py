"""Rotary position embedding (HF "rotate_half" layout), default, linear, llama3 and YaRN scaling.

The cos/sin table is computed once, in fp32 exactly as HF does (positions times inverse
frequencies, then cos and sin), and indexed by each token's absolute position, so varlen batches
and chunked prefill need nothing extra. Layout: cos_sin_cache [max_pos, D] with cos in [:, :D/2]
and sin in [:, D/2:], which is also what the Triton rotary kernel reads. YaRN's attention factor
(a scale on cos and sin) is folded into the table, so every path applies it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenforge.model.arch_config import RopeScaling
from tokenforge.model.layers.kernel_dispatch import triton_ops


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[D/2] fp32 inverse frequencies, with the configured scaling (linear, YaRN, llama3) applied,
    then divided by per-dimension `freq_factors` where the checkpoint gives them (GGUF)."""
    inv_freq = _scaled_inverse_frequencies(head_dim, theta, scaling)
    if scaling is not None and scaling.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    return inv_freq


def _scaled_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is not None and scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling is not None and scaling.rope_type == "yarn":
        return _yarn_inverse_frequencies(inv_freq, head_dim, theta, scaling)
    if scaling is None or scaling.rope_type != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths (beyond the original context / low_freq_factor) slow down by
    # `factor`, short ones (below original / high_freq_factor) are kept, and the band between blends.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_inverse_frequencies(inv_freq: torch.Tensor, head_dim: int, theta: float,
                              scaling: RopeScaling) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): dims that turn more than beta_fast times over the original context
    keep their frequency, dims that turn fewer than beta_slow times are divided by `factor`, and a
    linear ramp blends the dims between (HF's `_compute_yarn_parameters`)."""
    def dim_of(rotations: float) -> float:
        return head_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) \
            / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                                      # 1: extrapolate (keep), 0: interpolate
    return inv_freq / scaling.factor * (1 - keep) + inv_freq * keep


def attention_factor(scaling: RopeScaling | None) -> float:
    """The scale YaRN puts on cos and sin (1 for the other types)."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    return 1.0 if scaling.factor <= 1 else 0.1 * math.log(scaling.factor) + 1.0


def build_cos_sin_cache(head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None,
                        device: torch.device | None = None) -> torch.Tensor:
    """cos_sin_cache [max_position, head_dim] fp32."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)
    positions = torch.arange(max_position, dtype=torch.int64, device=device).float()
    freqs = torch.outer(positions, inv_freq)            # [max_pos, D/2]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    factor = attention_factor(scaling)
    return cache * factor if factor != 1.0 else cache


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        if torch.empty(0).is_meta:       # a meta-device build (parameter counts) needs shapes only
            cache = torch.empty(max_position, head_dim)
        else:
            cache = build_cos_sin_cache(head_dim, max_position, theta, scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq, D], k [T, Hkv, D] -> rotated (q, k)."""
        ops = triton_ops(q.device)
        if ops is not None and self.head_dim & (self.head_dim - 1) == 0:
            return ops.apply_rotary(q, k, positions, self.cos_sin_cache)   # in place
        cos_sin = self.cos_sin_cache[positions].to(q.dtype)              # [T, D]
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)                 # [T, 1, D/2] each
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)                                          # [T, H, D/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
