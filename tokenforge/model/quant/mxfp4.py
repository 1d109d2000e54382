"""MXFP4 checkpoints (gpt-oss): the experts' weights are 4-bit e2m1 codes with one e8m0 scale per
32 values (kernels/mxfp4.py has the format). Only the experts are quantized: the model config
says so (`MoeConfig.expert_format`, from `quantization_config.quant_method`), and the MoE layer
builds its MXFP4 parameters itself (layers/moe.py). So this scheme converts no linear; it only
refuses a checkpoint whose MXFP4 tensors have no experts to go to."""

from __future__ import annotations

from torch import nn

from tokenforge.model.quant.scheme import CheckpointScheme, unsupported


def parse(qc: dict) -> CheckpointScheme:
    return CheckpointScheme(kind="mxfp4", label="MXFP4 experts", group_size=32,
                            ignore=tuple(qc.get("modules_to_not_convert") or ()))


def prepare_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The linears this scheme converts (none), once the model is known to hold MXFP4 experts."""
    if not any(getattr(getattr(m, "moe", None), "expert_format", None) == "mxfp4" for m in model.modules()):
        raise unsupported(f"MXFP4 weights outside the experts of a mixture-of-experts model ({type(model).__name__})")
    return []
