"""The per-step forward context: attention metadata travels here, not through `forward()` arguments.

The model runner enters `set_forward_context(metadata)` around the model call. Attention layers
read it with `get_forward_context()`, so model code keeps the signature
`forward(input_ids, positions)` and stays CUDA-graph friendly (the metadata's tensors are
persistent buffers the runner refills in place). `lora_indices` [T] is the adapter slot of each
token row (-1: none), read by multi-adapter LoRA hooks (model/layers/lora.py); None when no
adapters are served.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: Any          # the active backend's metadata object
    lora_indices: Any = None    # torch.Tensor [T] int: each token row's adapter slot, -1 for none


_current: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any, lora_indices: Any = None) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ForwardContext(attn_metadata, lora_indices)
    try:
        yield _current
    finally:
        _current = previous


def current_forward_context() -> ForwardContext | None:
    """The context of the forward pass running now, or None outside one (training, tests)."""
    return _current


def get_forward_context() -> ForwardContext:
    assert _current is not None, "attention ran outside set_forward_context()"
    return _current
