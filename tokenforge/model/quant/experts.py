"""On-the-fly quantization of mixture-of-experts weights (the `FusedExperts` stacks of layers/moe.py).

The linears' methods (base.py) see one [out, in] weight each; a MoE layer's experts are two
stacks of E matrices that only the fused MoE kernel multiplies, so they are quantized here, after
loading, next to the linears:
- `fp8` and `fp8-sim`: every float expert stack becomes e4m3 codes with one fp32 scale per
  (expert, output row) (`FusedExperts.install_fp8`; kernels/moe_fp8.py), weight-only: the
  fused kernel widens the codes to the activations' dtype (W8A16), the CPU reference dequantizes
  the selected experts. fp8-sim stores the same codes: with weight-only experts there is no
  activation quantization to simulate, so its quality tables see what fp8 does to them. The
  router (`gate`) and Qwen2-MoE's `shared_expert_gate` are plain modules and stay in the model
  dtype; shared experts and dense-layer MLPs are linears and take the mode's linear method.
- Every other mode (int8, int4, 2:4, --prune-rate) leaves the experts as loaded, and says so in
  one warning line naming the dtype they keep (vLLM's online modes other than fp8 also leave a
  MoE's experts unquantized; refusing would take the mode's dense savings from MoE users).
- MXFP4 experts (gpt-oss) are already 4-bit: they stay so, with one info line.
"""

from __future__ import annotations

import logging
from collections import Counter

from torch import nn

from tokenforge.model.arch_config import FP8_EXPERT_MODES as EXPERT_MODES   # the modes that quantize experts

logger = logging.getLogger(__name__)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    from tokenforge.model.layers.moe import FusedExperts  # noqa: PLC0415 - MoE models only

    return [m for m in model.modules() if isinstance(m, FusedExperts)]


def quantize_experts(model: nn.Module, mode: str | None) -> int:
    """Quantize (or report on) the experts under on-the-fly `mode` (a --quantization or --sparsity
    value, "prune" for --prune-rate alone, or None); returns how many expert layers became fp8."""
    experts = expert_modules(model)
    if not mode or not experts:
        return 0
    formats = Counter(e.weight_format for e in experts)
    if formats["mxfp4"]:
        logger.info("%s: the experts of %d MoE layers are MXFP4 already and stay 4-bit", mode, formats["mxfp4"])
    dense = [e for e in experts if e.weight_format == "dense"]
    if not dense:
        return 0
    if mode not in EXPERT_MODES:
        dtype = str(dense[0].w13_weight.dtype).removeprefix("torch.")
        logger.warning("%s does not apply to MoE experts: the experts of %d layers stay in %s (only "
                       "--quantization fp8 quantizes them)", _label(mode), len(dense), dtype)
        return 0
    for e in dense:
        e.install_fp8()
    logger.info("%s: the experts of %d MoE layers in fp8 e4m3 (per-row scales, weight-only); routers in the "
                "model dtype", mode, len(dense))
    return len(dense)


def _label(mode: str) -> str:
    if mode == "prune":
        return "--prune-rate"
    return f"--sparsity {mode}" if mode == "2:4" else f"--quantization {mode}"


__all__ = ["EXPERT_MODES", "expert_modules", "quantize_experts"]
