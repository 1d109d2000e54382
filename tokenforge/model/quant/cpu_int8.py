"""Dynamic int8 on the CPU (`--quantization int8` there): fbgemm-packed int8 weights, one scale
per output channel (symmetric), activations quantized per call and per row (`Int8Weight`).

Which linears: the column-parallel ones (q/k/v and gate/up). o_proj and down_proj read the
attention output and the SwiGLU product, whose outlier channels per-tensor int8 activations lose:
on SmolLM2 quantizing them raised perplexity ~50%, not ~1%. The LM head stays float32 (its
logits decide every token).
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from tokenforge.model.quant.base import QuantMethod


class Int8Weight:
    """One linear's dynamic-int8 weight: fbgemm-packed planes of per-channel codes (`int8_planes`),
    the row sums of the dequantized weight, and the bias (added in float32 after the rescale)."""

    def __init__(self, planes: list, row_sums: torch.Tensor, bias: torch.Tensor | None):
        self.planes, self.row_sums, self.bias = planes, row_sums, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]. fbgemm quantizes its whole input on one asymmetric grid, so a
        row with a large activation (SmolLM2's first token) would coarsen every other row's codes.
        Each row is centred and scaled to [-1, 1] first, x = c + r * u, so that every row spans the
        grid, and W x = r * (W u) + c * (W 1): per-row quantization from one call. On the bundled
        model's 5,873-token quality text this took int8's perplexity from +3.9% to +1.0%. A
        single row (batch-1 decode) is already quantized on its own range and skips the rescale."""
        if x.shape[0] == 1:            # one row is its own grid already: skip ~50 us of rescaling
            out = self._matmul(x)
        else:
            lo, hi = torch.aminmax(x, dim=1, keepdim=True)
            centre, radius = (hi + lo).mul_(0.5), (hi - lo).mul_(0.5).clamp_(min=1e-30)
            out = self._matmul((x - centre).div_(radius)).mul_(radius).addcmul_(centre, self.row_sums)
        return out if self.bias is None else out.add_(self.bias)

    def _matmul(self, u: torch.Tensor) -> torch.Tensor:
        out = torch.ops.quantized.linear_dynamic(u, self.planes[0])
        for plane in self.planes[1:]:    # the same activation codes: the sum is the 8-bit product
            out += torch.ops.quantized.linear_dynamic(u, plane)
        return out


@functools.cache
def int8_weight_max() -> int:
    """The largest weight code one fbgemm call may see. Without AVX512-VNNI, fbgemm multiplies u8
    activations by s8 weights with vpmaddubsw, which adds each pair of products into a saturating
    int16: two full-range products (255 * 127 * 2) overflow it, and on such a host (CI's) the
    bundled model's int8 perplexity of a 30-token text went from -0.4% to 28x. Codes within +-64
    (255 * 64 * 2 < 2^15) cannot overflow. Not fbgemm's `reduce_range` (7-bit activations):
    activations carry the outliers, and that cost +26% on the same text; 7-bit weights +6%."""
    has_vnni = getattr(torch.cpu, "_is_vnni_supported", None)
    return 127 if has_vnni is not None and has_vnni() else 64


def int8_planes(codes: torch.Tensor, limit: int) -> list[torch.Tensor]:
    """Integer weight codes in [-127, 127] as planes within +-limit that sum to them: one plane
    when limit is 127, else two (the second is non-zero only where |code| > limit)."""
    if limit >= 127:
        return [codes]
    low = codes.clamp(-limit, limit)
    return [low, codes - low]


class CpuInt8Method(QuantMethod):
    """`int8_weight`: an Int8Weight (the layer's float weight is emptied). On a host without VNNI
    the codes are split into two planes that fbgemm cannot overflow (`int8_weight_max`), run as
    two calls whose sum is the 8-bit result."""

    name = "cpu-int8"

    @torch.no_grad()
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.detach().float()                          # [out, in]
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        codes = torch.round(weight / scales[:, None]).clamp_(-127, 127)
        zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)
        bias = layer.bias if getattr(layer, "bias", None) is not None and layer.tp_rank == 0 else None
        planes = []
        for plane in int8_planes(codes, int8_weight_max()):
            with warnings.catch_warnings():
                # fbgemm's prepacked linears still take qint8 tensors; torch's deprecation of
                # quantized tensor creation would otherwise print on every int8 run.
                warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor, torch\.quantize_per_channel")
                qweight = torch.quantize_per_channel(plane * scales[:, None], scales.double(), zero_points, 0,
                                                     torch.qint8)
            planes.append(torch.ops.quantized.linear_prepack(qweight, None))
        row_sums = codes.sum(dim=1) * scales          # the dequantized weight times ones: [out]
        layer.int8_weight = Int8Weight(planes, row_sums, None if bias is None else bias.detach().float())
        layer.weight.data = torch.empty(0)       # the int8 copy replaces the float32 weight
        layer.quant_method = self

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = layer.int8_weight(x.reshape(-1, x.shape[-1]))        # the bias is the one it was built with
        return out.reshape(*x.shape[:-1], out.shape[-1])


def quantize_linears_int8(model: nn.Module) -> int:
    """Dynamic int8 on every column-parallel linear of a loaded float32 model (the model itself
    when it is one). Returns the number of quantized layers."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError("int8 quantization needs PyTorch's fbgemm engine (x86 CPUs)")
    method = CpuInt8Method()
    layers = [m for m in model.modules() if getattr(m, "input_is_parallel", None) is False]
    for layer in layers:
        method.process_weights_after_loading(layer)
    return len(layers)


__all__ = ["CpuInt8Method", "Int8Weight", "int8_planes", "int8_weight_max", "quantize_linears_int8"]
