"""Which implementation the fused layers (norm, rotary, activation) use: torch or Triton.

The torch path is the reference and the CPU path. On CUDA, when `tokenforge.kernels` imports with
Triton available, the layers call its fused kernels instead. The choice is made per call from the
tensor's device (a dict lookup), so one model object works on either device, and tests can force
the torch path with `use_triton_kernels(False)`.
"""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import torch

logger = logging.getLogger(__name__)

_enabled = True


def use_triton_kernels(enabled: bool) -> None:
    """Allow (default) or forbid the Triton kernels; forbidding makes CUDA run the torch path."""
    global _enabled
    _enabled = enabled


@functools.cache
def _load_triton_ops() -> SimpleNamespace | None:
    try:
        from tokenforge.kernels import activation, rms_norm, rotary  # noqa: PLC0415 - optional
        from tokenforge.kernels._triton import HAS_TRITON  # noqa: PLC0415
    except ImportError as exc:  # kernels are optional: the torch path always works
        logger.info("Triton kernels unavailable (%s); using torch layers", exc)
        return None
    if not HAS_TRITON:
        return None
    return SimpleNamespace(
        rms_norm=rms_norm.rms_norm,
        fused_add_rms_norm=rms_norm.fused_add_rms_norm,
        apply_rotary=rotary.apply_rotary,
        silu_and_mul=activation.silu_and_mul,
    )


def triton_ops(device: torch.device) -> SimpleNamespace | None:
    """The Triton kernel namespace for tensors on `device`, or None to use torch."""
    if device.type != "cuda" or not _enabled:
        return None
    return _load_triton_ops()
