"""Pruning: unstructured magnitude pruning (`--prune-rate`) and 2:4 semi-structured sparsity
(`--sparsity 2:4`, `Sparse24Method`), for every parallel linear of a loaded float model (not the
lm_head or the embedding).

- prune_rate p: per linear, the fraction p of weights with the smallest |w| become zero. The
  weights stay dense, so this changes quality only (no speed or memory gain). It runs before any
  method processes its weights, so it composes with the quantization modes.
- 2:4: in every group of 4 consecutive inputs the 2 smallest |w| become zero. On CUDA with a
  16-bit dtype the layer also keeps a torch semi-structured sparse copy (cuSPARSELt or CUTLASS
  kernels on the GPU's sparse tensor cores) for steps of more than QGEMV_MAX_TOKENS rows; smaller
  steps keep the dense GEMV. Elsewhere (and for shapes the sparse kernels refuse) the pruned
  weight runs dense.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tokenforge.model.quant.dense import DenseMethod, become_dense
from tokenforge.model.quant.quantized import QGEMV_MAX_TOKENS

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


class Sparse24Method(DenseMethod):
    """The pruned float weight (`weight`: the GEMV for tiny steps) and its semi-structured sparse
    copy (`sparse_weight`) for the rest."""

    name = "2:4"

    def check(self, layer: nn.Module, name: str) -> None:
        if layer.in_features % 4:
            raise ValueError(f"2:4 sparsity needs an input size divisible by 4; {name} has {layer.in_features}")

    @torch.no_grad()
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        prune_2_4_(layer.weight.data)
        w = layer.weight
        if not (w.is_cuda and w.dtype in (torch.float16, torch.bfloat16)):
            become_dense(layer, w.detach())
            return
        try:
            layer.sparse_weight = torch.sparse.to_sparse_semi_structured(w.detach())
        except (RuntimeError, ValueError) as exc:     # shapes the sparse kernels do not take
            logger.info("2:4: a [%d, %d] linear stays dense on the GPU (%s)", *w.shape, exc)
            become_dense(layer, w.detach())

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] <= QGEMV_MAX_TOKENS:
            return super().apply(layer, x, bias)
        # the sparse kernels may return a transposed view; attention needs contiguous rows
        return F.linear(x, layer.sparse_weight, bias).contiguous()

    def apply_normed(self, layer, x, residual, norm, bias):
        return None

    def apply_silu_mul(self, layer, gate_up, bias):
        return None


@torch.no_grad()
def prune_model(layers: list[tuple[str, nn.Module]], rate: float) -> int:
    for _, layer in layers:
        prune_magnitude_(layer.weight.data, rate)
    logger.info("pruned %.0f%% of the weights of %d linears by magnitude: this changes quality only (the "
                "weights stay dense, so speed and memory are unchanged)", rate * 100, len(layers))
    return len(layers)


__all__ = ["SPARSITY_PATTERNS", "Sparse24Method", "prune_2_4_", "prune_magnitude_", "prune_model"]
