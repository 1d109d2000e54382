"""MKL-prepacked weights for the CPU float32 linears.

Why: MKL's sgemm repacks the weight matrix on every call. At decode's small row counts that
repacking costs about as much as the multiply itself; packing once at load time made a 32-row
SmolLM2 matmul 1.8x faster here, with bit-identical results (same kernel, no repack). The packed
copy costs one more copy of the linear weights, so it is only made on the CPU, in float32, when
torch was built with MKL and the weights are small enough (`MAX_PACKED_BYTES`).

The packed layout is tuned for `PACKED_ROWS`-row calls (decode batches). For one row it is no
faster than the plain weight (3072x576: 261 us plain, 276 us packed on a 2-core EPYC), and
packing SmolLM2 takes about 1 s of one core. So the model runner packs only when a decode batch
can reach that size (`packing_pays`): a one-prompt `generate` skips it, a server or a 32-prompt
bench does it once at start-up.
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

MAX_PACKED_BYTES = 4 * 2**30
PACKED_ROWS = 32      # the row count MKL tunes the packed layout for (decode batches)


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


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  packed: torch.Tensor | Int8Weight | None) -> torch.Tensor:
    """F.linear, through the prepacked weight when there is one. x [T, in] -> [T, out]."""
    if packed is None:
        return F.linear(x, weight, bias)
    if isinstance(packed, Int8Weight):            # the bias is the one it was built with
        out = packed(x.reshape(-1, x.shape[-1]))
        return out.reshape(*x.shape[:-1], out.shape[-1])
    if x.dim() != 2:
        return F.linear(x, weight, bias)
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, PACKED_ROWS)


def can_prepack() -> bool:
    return bool(torch._C.has_mkl) and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def packing_pays(max_num_seqs: int) -> bool:
    """Whether decode batches of PACKED_ROWS rows can occur (the only size the packed copy serves)."""
    return max_num_seqs >= PACKED_ROWS


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


def quantize_linears_int8(model: nn.Module) -> int:
    """Dynamic int8 for the CPU: each quantizable linear's weight becomes int8 per output channel
    (symmetric), packed for fbgemm; activations are quantized per call and per row (`Int8Weight`).
    On a host without VNNI the codes are split into two planes that fbgemm cannot overflow
    (`int8_weight_max`), run as two calls whose sum is the 8-bit result. The lm_head stays float32
    (its logits decide every token). Returns the number of quantized modules."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError("int8 quantization needs PyTorch's fbgemm engine (x86 CPUs)")
    count = 0
    for module in model.modules():
        if not getattr(module, "quantizable", False):
            continue
        weight = module.weight.detach().float()                          # [out, in]
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        codes = torch.round(weight / scales[:, None]).clamp_(-127, 127)
        zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)
        bias = module.bias if getattr(module, "bias", None) is not None and module.tp_rank == 0 else None
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
        module.packed_weight = Int8Weight(planes, row_sums, None if bias is None else bias.detach().float())
        module.weight.data = torch.empty(0)       # the int8 copy replaces the float32 weight
        count += 1
    return count


def prepack_linears(model: nn.Module) -> int:
    """Give every module with a `packed_weight` slot an MKL-packed copy of its 2-D float32 CPU
    weight. Returns the number of packed modules (0 when packing does not apply)."""
    modules = [m for m in model.modules() if hasattr(m, "packed_weight") and m.packed_weight is None
               and getattr(m, "quant_method", None) is None]      # a quantized layer computes from its own tensors
    weights = [m.weight for m in modules]
    if not modules or not can_prepack() or any(w.device.type != "cpu" or w.dtype != torch.float32 for w in weights):
        return 0
    total = sum(w.numel() * w.element_size() for w in weights)
    if total > MAX_PACKED_BYTES:
        logger.info("not prepacking %.1f GiB of linear weights (limit %.1f GiB)", total / 2**30,
                    MAX_PACKED_BYTES / 2**30)
        return 0
    for module in modules:
        module.packed_weight = torch.ops.mkl._mkl_reorder_linear_weight(module.weight.detach(), PACKED_ROWS)
    return len(modules)
