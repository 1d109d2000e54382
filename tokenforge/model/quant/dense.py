"""Dense weights: the float weight [out, in] as the checkpoint holds it, multiplied three ways.

- CUDA at decode sizes (<= GEMV_MAX_TOKENS rows, 16-bit, no autograd): the Triton GEMV
  (kernel_dispatch.gemv_ops), which also fuses the add + RMSNorm or SwiGLU before it where
  gemv.fuses_prologue says so, and with a LoRA hook the row's adapter delta (kernels/gemv_lora.py).
- The CPU in float32, when the runner asks for it (`prepack_linears`): an MKL-prepacked copy.
  MKL's sgemm repacks the weight on every call; at decode's small row counts that costs about
  as much as the multiply itself, and packing once made a 32-row SmolLM2 matmul 1.8x faster here
  with bit-identical results (same kernel, no repack). The copy costs one more copy of the
  weights, so it is made only on the CPU, in float32, with MKL, under `MAX_PACKED_BYTES`. The
  layout is tuned for `PACKED_ROWS`-row calls: for one row it is no faster than the plain weight
  (3072x576: 261 us plain, 276 us packed on a 2-core EPYC), and packing SmolLM2 takes about 1 s
  of one core, so the runner packs only when a decode batch can reach that size
  (`packing_pays`).
- Everything else: F.linear (cuBLAS, or the CPU's BLAS).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tokenforge.model.layers.kernel_dispatch import gemv_ops
from tokenforge.model.quant.base import QuantMethod, drop_weights

logger = logging.getLogger(__name__)

MAX_PACKED_BYTES = 4 * 2**30
PACKED_ROWS = 32      # the row count MKL tunes the packed layout for (decode batches)


class DenseMethod(QuantMethod):
    """The float weight (`layer.weight`), and on the CPU its MKL-packed copy (`layer.mkl_weight`)."""

    name = "dense"

    def create_weights(self, layer: nn.Module) -> None:
        super().create_weights(layer)
        layer.mkl_weight = None

    def matmul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """F.linear, through the packed copy when there is one. x [T, in] -> [T, out]."""
        packed = layer.mkl_weight
        if packed is None or x.dim() != 2:
            return F.linear(x, layer.weight, bias)
        return torch.ops.mkl._mkl_linear(x, packed, layer.weight, bias, PACKED_ROWS)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ops = gemv_ops(x, layer.weight) if layer.mkl_weight is None else None
        return ops.gemv(x, layer.weight, bias) if ops is not None else self.matmul(layer, x, bias)

    def apply_normed(self, layer, x, residual, norm, bias):
        ops = gemv_ops(x, layer.weight) if layer.mkl_weight is None else None
        if ops is None or not ops.fuses_prologue(*layer.weight.shape):
            return None
        return ops.add_rms_norm_gemv(x, residual, norm.weight, norm.eps, layer.weight, bias)

    def apply_silu_mul(self, layer, gate_up, bias):
        ops = gemv_ops(gate_up, layer.weight) if layer.mkl_weight is None else None
        if ops is None or not ops.fuses_prologue(*layer.weight.shape):
            return None
        return ops.silu_mul_gemv(gate_up, layer.weight, bias)

    def fuse_lora_a(self, layer, rows):
        weight = layer.weight
        if weight.dim() != 2:
            return None
        layer.mkl_weight = None       # packed for the plain weight; the products now read the larger one
        n = weight.shape[0]
        cat = torch.zeros(n + rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
        cat[:n].copy_(weight)
        weight.data = cat[:n]
        bias = getattr(layer, "bias", None)
        bias_cat = None
        if bias is not None:
            bias_cat = torch.zeros(n + rows, dtype=bias.dtype, device=bias.device)
            bias_cat[:n].copy_(bias)
            bias.data = bias_cat[:n]
        return cat, bias_cat

    def apply_lora(self, layer, x, bias, lora, norm=None, residual=None, silu_mul=False, defer=False):
        cat = lora.in_gemm
        if (cat is not None and x.dim() == 2 and 1 < x.shape[0] <= cat.max_rows and norm is None and not silu_mul
                and not defer):
            # the shrink of every slot in the product's extra columns, then the expand of each row's
            out = F.linear(x, cat.weight, cat.bias if bias is not None else None)
            return cat.expand(out[:, cat.rows:], out[:, :cat.rows]), None, None
        ops = gemv_ops(x, layer.weight) if layer.mkl_weight is None else None
        if ops is None or x.shape[0] != 1 or lora.indices.shape[0] != 1:
            return None
        if (norm is not None or silu_mul) and not ops.fuses_prologue(*layer.weight.shape):
            return None           # as apply_normed / apply_silu_mul: the layer runs the prologue first
        if defer:
            kind = ops.prologues.norm if norm is not None else (ops.prologues.silu_mul if silu_mul else ops.prologues.plain)
            return ops.gemv_lora_deferred(kind, x, layer.weight, bias, lora, residual,
                                          norm.weight if norm is not None else None, norm.eps if norm is not None else 0.0)
        if norm is not None:
            return (*ops.add_rms_norm_gemv_lora(x, residual, norm.weight, norm.eps, layer.weight, bias, lora), None)
        fn = ops.silu_mul_gemv_lora if silu_mul else ops.gemv_lora
        return fn(x, layer.weight, bias, lora), None, None


DENSE = DenseMethod()


def become_dense(layer: nn.Module, weight: torch.Tensor) -> None:
    """Run the layer as dense from now on, with `weight` [out, in] (a format the CPU simulates by
    dequantizing it at load, or a weight no faster kernel takes)."""
    drop_weights(layer)
    layer.weight = nn.Parameter(weight.to(layer.params_dtype), requires_grad=False)
    layer.mkl_weight = None
    layer.quant_method = DENSE


def can_prepack() -> bool:
    return bool(torch._C.has_mkl) and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def packing_pays(max_num_seqs: int) -> bool:
    """Whether decode batches of PACKED_ROWS rows can occur (the only size the packed copy serves)."""
    return max_num_seqs >= PACKED_ROWS


def prepack_linears(model: nn.Module) -> int:
    """Give every layer run by a dense method an MKL-packed copy of its 2-D float32 CPU weight.
    Returns the number of packed layers (0 when packing does not apply)."""
    layers = [m for m in model.modules()
              if isinstance(getattr(m, "quant_method", None), DenseMethod) and m.mkl_weight is None]
    weights = [m.weight for m in layers]
    if not layers or not can_prepack() or any(w.device.type != "cpu" or w.dtype != torch.float32 for w in weights):
        return 0
    total = sum(w.numel() * w.element_size() for w in weights)
    if total > MAX_PACKED_BYTES:
        logger.info("not prepacking %.1f GiB of linear weights (limit %.1f GiB)", total / 2**30,
                    MAX_PACKED_BYTES / 2**30)
        return 0
    for layer in layers:
        layer.mkl_weight = torch.ops.mkl._mkl_reorder_linear_weight(layer.weight.detach(), PACKED_ROWS)
    return len(layers)


__all__ = ["DENSE", "DenseMethod", "become_dense", "can_prepack", "packing_pays", "prepack_linears"]
