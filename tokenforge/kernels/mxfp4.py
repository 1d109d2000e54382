"""MXFP4 (OCP microscaling FP4): 4-bit e2m1 values sharing one 8-bit power-of-two scale per 32.

Layout, as gpt-oss checkpoints store it: `blocks` uint8 [..., R, G, 16], two values a byte (the
low nibble is the even element), and `scales` uint8 [..., R, G], e8m0 (2 ** (s - 127)); row r of
the matrix is its G groups of 32 values. Out: the float matrix [..., R, G * 32].

`Mxfp4Stack` is a stack of such matrices (one per expert) that `[e]` dequantizes one at a time,
so the torch reference MoE (kernels/moe.py) keeps the experts 4-bit in memory and expands only
the ones a batch selects.
"""

from __future__ import annotations

import torch

GROUP = 32
E8M0_BIAS = 127
# e2m1 codes 0..15: sign bit 3, then 2 exponent bits and 1 mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., R, G, 16] uint8, scales [..., R, G] uint8 -> [..., R, G * 32] in dtype."""
    assert blocks.shape[:-1] == scales.shape and blocks.shape[-1] == GROUP // 2, (blocks.shape, scales.shape)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)   # [..., G, 16, 2]
    values = values.flatten(-2) * torch.exp2(scales.float() - E8M0_BIAS)[..., None]          # [..., G, 32]
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., R, C] (C a multiple of 32) -> (blocks, scales), rounding each value to the
    nearest code under its group's scale (the largest magnitude maps at or below 6). For tests
    and dummy weights; checkpoints arrive quantized."""
    *lead, cols = w.shape
    assert cols % GROUP == 0, f"{cols} columns do not split into groups of {GROUP}"
    groups = w.float().reshape(*lead, cols // GROUP, GROUP)
    amax = groups.abs().amax(-1).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = groups / torch.exp2(exp)[..., None]
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=w.device)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)                       # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + E8M0_BIAS).to(torch.uint8)


class Mxfp4Stack:
    """An expert stack [E, R, C] held as MXFP4; `[e]` is expert e's float32 matrix [R, C]."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        self.blocks, self.scales = blocks, scales
        self.shape = (*blocks.shape[:-2], blocks.shape[-2] * GROUP)

    def __getitem__(self, expert: int) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks[expert], self.scales[expert])
