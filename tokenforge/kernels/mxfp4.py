"""MXFP4 (OCP microscaling FP4): 4-bit e2m1 values sharing one 8-bit power-of-two scale per 32.

Layout, as gpt-oss checkpoints store it: `blocks` uint8 [..., R, G, 16], two values a byte (the
low nibble is the even element), and `scales` uint8 [..., R, G], e8m0 (2 ** (s - 127)); row r of
the matrix is its G groups of 32 values. Out: the float matrix [..., R, G * 32].

`Mxfp4Stack` is a stack of such matrices (one per expert) that `[e]` dequantizes one at a time,
so the torch reference MoE (kernels/moe.py) keeps the experts 4-bit in memory and expands only
the ones a batch selects. `fp4_weight_tiles`, `fp4_pair` and `fp4_scale` are the Triton decode
the fused MoE kernels (kernels/moe.py, kernels/moe_gemv.py) share.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton

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


@triton.jit
def fp4_weight_tiles(w_ptrs, s_ptrs, mask):
    """An MXFP4 tile as two [BLOCK_K / 2, BLOCK_N] fp32 tiles, the even k (low nibbles) and the odd
    k (high nibbles) of the bytes at `w_ptrs`, each value decoded from e2m1 times its group's e8m0
    scale. The bytes are loaded once, contiguous along K (16-byte loads down each weight row); a
    tile of one byte per k would read each byte twice with no contiguity for the loads to
    coalesce on. A code (sign s, exponent e, mantissa m) placed in an fp16 bit pattern as sign bit
    15, exponent bits 11-10 and mantissa bit 9 is 2^(e-15) * (1 + m/2) for e > 0 and m * 2^-15 for
    e = 0 (a subnormal the conversion keeps): e2m1's value times 2^-14, which the scale takes
    back. So a value costs a few integer ops and one conversion. e8m0 s is 2^(s-127): with the
    2^14, the fp32 exponent field s + 14 (s = 0, a subnormal 2^-127, is spelled out; an s that
    would overflow, >= 241, saturates to infinity, as 2^114 * a value > 2^127 does anyway)."""
    scale = fp4_scale(tl.load(s_ptrs, mask=mask, other=127))
    lo, hi = fp4_pair(tl.load(w_ptrs, mask=mask, other=0))
    return lo * scale, hi * scale


@triton.jit
def fp4_scale(s):
    """e8m0 scale bytes -> fp32 2^(s - 127) times the 2^14 that `fp4_pair`'s values lack."""
    s = s.to(tl.int32)
    return tl.where(s == 0, 5.877471754111438e-39 * 16384.0,
                    (tl.minimum(s + 14, 255) << 23).to(tl.float32, bitcast=True))


@triton.jit
def fp4_pair(byte):
    """MXFP4 bytes -> (low-nibble values, high-nibble values) in fp32, each e2m1 value times 2^-14
    (`fp4_weight_tiles` says how)."""
    byte = byte.to(tl.int32)
    lo = ((byte << 12) & 0x8000) | ((byte << 9) & 0x0E00)
    hi = ((byte << 8) & 0x8000) | ((byte << 5) & 0x0E00)
    return f16_bits(lo), f16_bits(hi)


@triton.jit
def f16_bits(bits):
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
