"""Calibrated int4 (`--quantization int4 --quantization-calibration FILE|builtin`): GPTQ codes
computed at load from the activations of a calibration text.

In: the loaded float model, the linears to quantize, the calibration text as token ids (the
engine tokenizes it: config/calibration.py reads it, engine_core.py encodes it). Out: each
linear's `calibrated_int4` = its GPTQ (packed codes, scales, zeros) (gptq.py), which Int4Method
installs instead of round-to-nearest codes when it processes the layer.

One pass over the float model: the ids are cut into windows of CALIBRATION_WINDOW tokens (at
most MAX_WINDOWS; a shorter tail is dropped), each window runs as one causal sequence with no KV
cache (the training forward), and a pre-hook on every linear adds x^T x of its input. Every
Hessian is measured on the float model, so the layers' GPTQ runs are independent, and the layers
of one shape run as one batch (gptq.py). Memory: one
K x K float32 matrix per linear while loading (SmolLM2-135M: 0.4 GB; Llama-3.1-8B: about 33 GB,
mostly the down projections' 14336^2), freed as each layer is quantized.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from tokenforge.config.calibration import CALIBRATION_WINDOW, MAX_WINDOWS
from tokenforge.model.quant.gptq import gptq_int4_groups

logger = logging.getLogger(__name__)


def calibration_windows(token_ids, window: int = CALIBRATION_WINDOW, max_windows: int = MAX_WINDOWS
                        ) -> torch.Tensor:
    """The ids as [W, window] full windows (W >= 1)."""
    count = min(len(token_ids) // window, max_windows)
    if count < 1:
        raise ValueError(f"the int4 calibration text has {len(token_ids)} tokens, fewer than one window of {window}")
    return torch.tensor(list(token_ids[: count * window]), dtype=torch.long).reshape(count, window)


@torch.no_grad()
def record_hessians(model: nn.Module, layers: list[tuple[str, nn.Module]], token_ids) -> None:
    """Set `layer.calibration_hessian` = sum of x x^T over the calibration tokens, for every layer."""
    windows = calibration_windows(token_ids)
    device = next(model.parameters()).device
    lm_head = getattr(model, "lm_head", None)

    def hook(layer, args):
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        layer.calibration_hessian.addmm_(x.t(), x)

    handles = []
    for _, layer in layers:
        layer.calibration_hessian = torch.zeros(layer.in_features, layer.in_features, device=device)
        handles.append(layer.register_forward_pre_hook(hook))
    start = time.perf_counter()
    try:
        for row in windows:
            hidden = model(row[None].to(device), None)                # [1, S, H]: one causal sequence
            if lm_head is not None and any(layer is lm_head for _, layer in layers):
                model.compute_logits(hidden.reshape(-1, hidden.shape[-1]))
    finally:
        for handle in handles:
            handle.remove()
    logger.info("int4 calibration: %d windows of %d tokens through the float model in %.1f s", len(windows),
                windows.shape[1], time.perf_counter() - start)


@torch.no_grad()
def calibrate_int4(model: nn.Module, layers: list[tuple[str, nn.Module]], token_ids, group: int) -> None:
    """Leave every layer `calibrated_int4` = its GPTQ (packed, scale, zero), which Int4Method
    installs. Layers of one shape run as one batch (one column loop for all of them)."""
    record_hessians(model, layers, token_ids)
    start = time.perf_counter()
    by_shape: dict[tuple, list[nn.Module]] = {}
    for _, layer in layers:
        w = layer.weight
        by_shape.setdefault((tuple(w.shape), w.dtype, w.device), []).append(layer)
    for (_, dtype, _), same in by_shape.items():
        for chunk in _chunks(same, _batch_rows(same[0])):
            hessians = torch.stack([layer.__dict__.pop("calibration_hessian") for layer in chunk])
            codes = gptq_int4_groups(torch.stack([layer.weight.detach() for layer in chunk]), hessians, group, dtype)
            del hessians
            for layer, c in zip(chunk, codes):
                layer.calibrated_int4 = c
    logger.info("int4 calibration: GPTQ of %d linears (group %d) in %.1f s", len(layers), group,
                time.perf_counter() - start)


def _batch_rows(layer: nn.Module) -> int:
    """Layers per GPTQ batch: about 2**27 weight elements (0.5 GB of float32 working copies)."""
    return max(1, (1 << 27) // (layer.out_features * layer.in_features))


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i:i + size]


__all__ = ["calibrate_int4", "calibration_windows", "record_hessians"]
