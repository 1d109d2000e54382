"""torch's tinygemm int4 kernel (`aten._weight_int4pack_mm`, CUDA, bf16) as a backend for our int4.

Our format: codes q in [0, 15], w = (q - z) * s per (row, group), canonical uint8 [N, K/2] with the
low nibble the even input. tinygemm's: w = (q - 8) * s + zf with zf a float per (row, group), and
its own tiled packing from `_convert_weight_to_int4pack(uint8 [N, K/2] with the HIGH nibble the
even input, inner_k_tiles)`. So zf = (8 - z) * s and the nibbles swap before packing.
scale_and_zeros is bf16 [K/G, N, 2] = (s, zf). Limits (torch 2.11 CUDA): x bf16, N % 8 == 0,
K % (16 * inner_k_tiles) == 0, G in {32, 64, 128, 256}, inner_k_tiles in {2, 4, 8}.
"""

from __future__ import annotations

import torch

GROUPS = (32, 64, 128, 256)


def unsupported(n: int, k: int, group: int, inner_k_tiles: int = 8) -> str | None:
    """Why tinygemm cannot run an [n, k] int4 weight with this group, or None."""
    if group not in GROUPS:
        return f"tinygemm takes group sizes {GROUPS}, not {group}"
    if n % 8:
        return f"tinygemm needs the output size divisible by 8 (got {n})"
    if k % (16 * inner_k_tiles):
        return f"tinygemm needs the input size divisible by {16 * inner_k_tiles} (got {k})"
    return None


def scale_and_zeros(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Ours, [N, K/G] each -> tinygemm's bf16 [K/G, N, 2] (s, (8 - z) * s)."""
    s = scale.float()
    zf = (8.0 - zero.float()) * s
    return torch.stack((s, zf), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)


def dequantize_ref(q: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """tinygemm's formula on unpacked codes [N, K] -> fp32 [N, K] (to check scale_and_zeros)."""
    s = sz[..., 0].t().float().repeat_interleave(group, dim=1)
    zf = sz[..., 1].t().float().repeat_interleave(group, dim=1)
    return (q.float() - 8.0) * s + zf


def swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Low-nibble-first bytes -> high-nibble-first (tinygemm's input order)."""
    return ((packed & 0xF) << 4) | (packed >> 4)


def pack(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, inner_k_tiles: int = 8
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Our canonical packed weight, scales and zeros -> (tinygemm weight, scale_and_zeros)."""
    weight = torch.ops.aten._convert_weight_to_int4pack(swap_nibbles(packed).contiguous(), inner_k_tiles)
    return weight, scale_and_zeros(scale, zero)


def matmul(x: torch.Tensor, weight: torch.Tensor, sz: torch.Tensor, group: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype (tinygemm runs in bf16)."""
    y = torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16), weight, group, sz)
    y = y.to(x.dtype)
    return y + bias if bias is not None else y


__all__ = ["GROUPS", "dequantize_ref", "matmul", "pack", "scale_and_zeros", "swap_nibbles", "unsupported"]
