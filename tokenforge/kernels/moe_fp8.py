"""fp8 experts: an expert stack held as float8_e4m3fn codes with one fp32 scale per output row.

In: a float stack [E, N, K] (a MoE layer's `w13` [E, 2I, H] or `w2` [E, H, I]). Out: codes
[E, N, K] e4m3 and scales [E, N] fp32, scale = amax of the row / 448 (the dense fp8 linears'
per-channel rule, applied per expert and row), so expert e's matrix is codes[e] * scales[e][:, None].

The fused MoE GEMMs (kernels/moe.py) read the codes as stored (1 byte a value), widen each tile to
the activations' dtype (every e4m3 value is exact in bf16, fp16 and fp32), and multiply the fp32
accumulator by the row's scale in the epilogue: a row's scale is constant along K, so that equals
the product with the dequantized matrix up to rounding. Activations stay in the model dtype
(weight-only, W8A16). `Fp8Stack[e]` dequantizes one expert at a time, so the torch reference MoE
(the CPU path) keeps the codes 1 byte a value too and expands only the experts a batch selects.
"""

from __future__ import annotations

import torch

from .quant_ops import FP8_MAX

_MIN_SCALE = 1e-12              # an all-zero row: zero codes, not NaN


def quantize_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., N, K] -> (float8_e4m3fn [..., N, K], fp32 scale [..., N])."""
    wf = w.float()
    scale = (wf.abs().amax(dim=-1) / FP8_MAX).clamp_min(_MIN_SCALE)
    return (wf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize_fp8_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., N, K], scales [..., N] -> [..., N, K] in dtype (the product in fp32)."""
    return (codes.float() * scales.float()[..., None]).to(dtype)


@torch.no_grad()
def quantize_fp8_stack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8_rows of [E, N, K], one expert at a time, so the fp32 temporaries are one
    expert's (Mixtral's gate-up: 0.5 GB, not 3.8 GB for the stack)."""
    codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scales = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        codes[e], scales[e] = quantize_fp8_rows(w[e])
    return codes, scales


class Fp8Stack:
    """An expert stack [E, N, K] held as e4m3 codes and per-row scales; `[e]` is expert e's
    float32 matrix [N, K]."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        assert codes.dtype == torch.float8_e4m3fn and scales.shape == codes.shape[:2], (codes.dtype, scales.shape)
        self.codes, self.scales = codes, scales
        self.shape = tuple(codes.shape)

    def __getitem__(self, expert: int) -> torch.Tensor:
        return dequantize_fp8_rows(self.codes[expert], self.scales[expert])

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole stack [E, N, K] in dtype (tests)."""
        return dequantize_fp8_rows(self.codes, self.scales, dtype)


__all__ = ["FP8_MAX", "Fp8Stack", "dequantize_fp8_rows", "quantize_fp8_rows", "quantize_fp8_stack"]
