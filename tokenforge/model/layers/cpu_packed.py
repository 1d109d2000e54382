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

import logging
import warnings

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

MAX_PACKED_BYTES = 4 * 2**30
PACKED_ROWS = 32      # the row count MKL tunes the packed layout for (decode batches)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  packed: torch.Tensor | None) -> torch.Tensor:
    """F.linear, through the prepacked weight when there is one. x [T, in] -> [T, out]."""
    if packed is None:
        return F.linear(x, weight, bias)
    if not isinstance(packed, torch.Tensor):          # int8 (fbgemm): the bias is packed with the weight
        out = torch.ops.quantized.linear_dynamic(x.reshape(-1, x.shape[-1]), packed)
        return out.reshape(*x.shape[:-1], out.shape[-1])
    if x.dim() != 2:
        return F.linear(x, weight, bias)
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, PACKED_ROWS)


def can_prepack() -> bool:
    return bool(torch._C.has_mkl) and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def packing_pays(max_num_seqs: int) -> bool:
    """Whether decode batches of PACKED_ROWS rows can occur (the only size the packed copy serves)."""
    return max_num_seqs >= PACKED_ROWS


def quantize_linears_int8(model: nn.Module) -> int:
    """Dynamic int8 for the CPU: each quantizable linear's weight becomes int8 per output channel
    (symmetric), packed for fbgemm; activations are quantized per call. The lm_head stays float32
    (its logits decide every token). Returns the number of quantized modules."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError("int8 quantization needs PyTorch's fbgemm engine (x86 CPUs)")
    count = 0
    for module in model.modules():
        if not getattr(module, "quantizable", False):
            continue
        weight = module.weight.detach().float()                          # [out, in]
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-8).double()
        zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)
        with warnings.catch_warnings():
            # fbgemm's prepacked linears still take qint8 tensors; torch's deprecation of
            # quantized tensor creation would otherwise print on every int8 run.
            warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor, torch\.quantize_per_channel")
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        bias = module.bias if getattr(module, "bias", None) is not None and module.tp_rank == 0 else None
        module.packed_weight = torch.ops.quantized.linear_prepack(qweight, bias)
        module.weight.data = torch.empty(0)       # the int8 copy replaces the float32 weight
        count += 1
    return count


def prepack_linears(model: nn.Module) -> int:
    """Give every module with a `packed_weight` slot an MKL-packed copy of its 2-D float32 CPU
    weight. Returns the number of packed modules (0 when packing does not apply)."""
    modules = [m for m in model.modules() if hasattr(m, "packed_weight") and m.packed_weight is None]
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
