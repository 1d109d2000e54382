"""Attention backends: `get_attention_backend("torch" | "triton", device)`.

"torch" is the reference and CPU path; "triton" (GPU) is imported lazily so CPU installs never
touch it.
"""

from __future__ import annotations

import torch

from tokenforge.model.attention.backend import AttentionBackend, AttentionBatch
from tokenforge.model.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionBatch", "TorchAttentionBackend", "get_attention_backend"]


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    device = torch.device(device)
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        if device.type != "cuda":
            raise ValueError(f"the triton attention backend needs a CUDA device, got {device}; use 'torch'")
        try:
            from tokenforge.model.attention.triton_backend import TritonAttentionBackend  # noqa: PLC0415
        except ImportError as exc:
            raise RuntimeError(f"the triton attention backend could not be imported ({exc}); "
                               "install triton or use --attention-backend torch") from exc
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; expected 'torch' or 'triton'")
