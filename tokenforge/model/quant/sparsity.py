"""Pruning: unstructured magnitude pruning (`--prune-rate`) and 2:4 semi-structured sparsity
(`--sparsity 2:4`), applied to every parallel linear of a loaded float model (not the lm_head or
the embedding).

- prune_rate p: per linear, the fraction p of weights with the smallest |w| become zero. The
  weights stay dense, so this changes quality only (no speed or memory gain).
- 2:4: in every group of 4 consecutive inputs the 2 smallest |w| become zero. On CUDA with a
  16-bit dtype the weight becomes a torch semi-structured sparse tensor (cuSPARSELt or CUTLASS
  kernels on the GPU's sparse tensor cores) for steps of more than QGEMV_MAX_TOKENS rows; smaller
  steps keep the dense GEMV. On the CPU the pruned weight stays dense.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tokenforge.model.layers.linear import ColumnParallelLinear, RowParallelLinear, dense_linear
from tokenforge.model.quant.methods import QGEMV_MAX_TOKENS, LinearMethod

logger = logging.getLogger(__name__)

SPARSITY_PATTERNS = ("2:4",)


def prune_magnitude_(w: torch.Tensor, rate: float) -> None:
    """Zero the fraction `rate` of entries with the smallest magnitude, in place."""
    k = int(rate * w.numel())
    if k <= 0:
        return
    threshold = w.abs().float().flatten().kthvalue(k).values
    w.masked_fill_(w.abs().float() <= threshold, 0)


def prune_2_4_(w: torch.Tensor) -> None:
    """Keep the 2 largest |w| of every 4 consecutive inputs, in place. w [N, K], K % 4 == 0."""
    n, k = w.shape
    groups = w.view(n, k // 4, 4)
    keep = groups.abs().topk(2, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    groups.masked_fill_(~mask, 0)


class SemiStructured24(LinearMethod):
    """A 2:4-pruned weight: the dense copy for tiny steps (the GEMV), the sparse one above."""

    name = "2:4"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] <= QGEMV_MAX_TOKENS:
            return dense_linear(x, layer.weight, bias, None)
        # the sparse kernels may return a transposed view; attention needs contiguous rows
        return F.linear(x, layer.sparse_weight, bias).contiguous()

    def apply_normed(self, layer, norm, x, residual):
        return None

    def apply_silu_mul(self, layer, act_fn, gate_up, bias):
        return None


def _linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


@torch.no_grad()
def prune_model(model: nn.Module, rate: float) -> int:
    layers = _linears(model)
    for _, layer in layers:
        prune_magnitude_(layer.weight.data, rate)
    logger.info("pruned %.0f%% of the weights of %d linears by magnitude: this changes quality only (the "
                "weights stay dense, so speed and memory are unchanged)", rate * 100, len(layers))
    return len(layers)


@torch.no_grad()
def sparsify_model(model: nn.Module, pattern: str) -> int:
    """2:4-prune every linear; on CUDA (16-bit) attach the semi-structured sparse weight."""
    if pattern not in SPARSITY_PATTERNS:
        raise ValueError(f"sparsity {pattern!r} is not supported: only 2:4 (what sparse tensor cores run)")
    layers = _linears(model)
    for name, layer in layers:
        if layer.weight.shape[1] % 4:
            raise ValueError(f"2:4 sparsity needs an input size divisible by 4; {name} has {layer.weight.shape[1]}")
    sparse = 0
    for name, layer in layers:
        prune_2_4_(layer.weight.data)
        if layer.weight.is_cuda and layer.weight.dtype in (torch.float16, torch.bfloat16):
            try:
                layer.sparse_weight = torch.sparse.to_sparse_semi_structured(layer.weight.detach())
            except (RuntimeError, ValueError) as exc:     # shapes the sparse kernels do not take
                logger.info("2:4: %s stays dense on the GPU (%s)", name, exc)
                continue
            layer.quant_method = SemiStructured24()
            sparse += 1
    logger.info("2:4 sparsity: %d linears pruned, %d run as semi-structured sparse tensors", len(layers), sparse)
    return len(layers)


__all__ = ["SPARSITY_PATTERNS", "SemiStructured24", "prune_2_4_", "prune_magnitude_", "prune_model",
           "sparsify_model"]
